"""The reward model in one process (no Ray): an RM kind (:mod:`.outcome`, :mod:`.process`, :mod:`.judge`) composed
with an engine (:mod:`.transformers_engine`, :mod:`.vllm_engine`) by :class:`~.scorer.RewardModelScorer`."""
