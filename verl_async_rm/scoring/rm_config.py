"""Settings of an RM replica: :class:`RMConfig`, the only thing the replicas and the scorer receive; its kind and
engine refuse what they cannot do in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from verl_async_rm.endpoint_urls import check_endpoints
from verl_async_rm.errors import ConfigValueError
from verl_async_rm.options import check_options, option
from verl_async_rm.scoring import vllm_engine
from verl_async_rm.scoring.group_judge import GroupJudgeKind
from verl_async_rm.scoring.judge import JudgeGenerateKind, JudgeLogitsKind
from verl_async_rm.scoring.outcome import Kind, OutcomeKind
from verl_async_rm.scoring.pairwise import ORDERS, PLANS
from verl_async_rm.scoring.pairwise_judge import PairwiseGenerateKind, PairwiseLogitsKind
from verl_async_rm.scoring.process import ProcessKind

__all__ = ["RMConfig", "PLACEMENTS", "KINDS", "JUDGE_KINDS", "GROUPED_KINDS", "kind_class", "LOADED_ONLY_KEYS",
           "REMOTE_ONLY_KEYS"]

#: Where the replicas run: ``own_pool`` (a reward pool of their own, ``reward.reward_model.enable_resource_pool=True``)
#: or ``policy_pool`` (the bundles of verl's actor/rollout pool, asleep while the policy trains; ``=False``).
PLACEMENTS = ("own_pool", "policy_pool")

#: The kind of each ``(reward_kind, judge_readout)``; ``judge_readout`` only tells judges apart.
KINDS: dict[tuple[str, str | None], type[Kind]] = {
    ("outcome", None): OutcomeKind, ("process", None): ProcessKind, ("judge", "logits"): JudgeLogitsKind,
    ("judge", "generate"): JudgeGenerateKind, ("group_judge", None): GroupJudgeKind,
    ("pairwise_judge", "logits"): PairwiseLogitsKind, ("pairwise_judge", "generate"): PairwiseGenerateKind}
#: The kinds that ask a causal LM (the judge_* keys).
JUDGE_KINDS = ("judge", "group_judge", "pairwise_judge")
#: The kinds whose trajectories wait for their GRPO group (the group gate).
GROUPED_KINDS = ("group_judge", "pairwise_judge")
_JUDGE_KEYS = ("judge_prompt", "judge_tokens", "judge_pattern", "judge_labels", "judge_readout", "judge_request_extra")
#: Keys only the judges of a group read (a group judge's, a pairwise judge's), and those only a group judge reads.
_GROUP_KEYS = ("judge_seed", "group_wait_s")
_PAIR_KEYS = ("pair_plan", "pair_k", "pair_orders", "pair_aggregate")
#: Keys that only some kinds read: an extra RM of another kind than the main one does not take them from the top.
KIND_KEYS = ("score_index", "score_reduction", "score_head", "score_output_field", *_JUDGE_KEYS, "judge_max_tokens",
             "judge_retries", "judge_temperature", "judge_scale", *_GROUP_KEYS, *_PAIR_KEYS, "step_delimiter",
             "step_separator", "process_label_index", "process_reduction")
_POOL_FIX = "set {key} to a positive integer (one RM replica on one GPU: n_gpus_per_node=1, nnodes=1)"
_SECONDS = {"above": 0, "why": "must be a positive number of seconds", "fix": "set {key}=300"}


@dataclass(frozen=True)
class RMConfig:
    """How to load, feed and place the reward model (RM) worker group."""

    model_path: str | None = option(
        None, "Local directory of a HuggingFace RM (config, weights, tokenizer). With endpoint: optional, the same "
        "checkpoint the server serves (its tokenizer counts tokens and renders templates as the server does).", str,
        optional=True, fix="set it to the RM's local directory")
    policy_tokenizer_path: str | None = option(
        None, "Local directory of the policy's tokenizer, to decode responses for an RM with another tokenizer or "
        "template. Required unless retemplate='never'.", str, optional=True)
    retemplate: str = option(
        "auto", "'auto': re-render the conversation with the RM's chat template when its tokenizer or template "
        "differs from the policy's, else reuse the ids; 'always'; 'never'.",
        choices=("auto", "always", "never"), why="unknown mode")
    dtype: str = option("auto", "Weights dtype: 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16', 'float16', "
                        "'float32'.", choices=("auto", "bfloat16", "float16", "float32"), why="unknown dtype")
    attn_implementation: str = option(
        "sdpa", "HF attention implementation ('sdpa', 'eager', ...); packed forwards use the plugin's own.",
        fix="use 'sdpa' or 'eager'")
    trust_remote_code: bool = option(False, "Run the RM repository's own Python code. Only for code you trust.")
    max_length: int | None = option(
        None, "Longest RM input in tokens; longer ones lose the start of the prompt. None: the model's "
        "max_position_embeddings.", int, optional=True, least=2, why="must be an integer >= 2 or None",
        fix="set a token count such as 4096")
    score_index: int = option(0, "Which output of a multi-output head is the reward (-1: the last).",
                              fix="use 0 for one-output RMs")
    score_reduction: str = option(
        "index", "'index' (score_index) or a reduction over all outputs: 'mean', 'sum', 'max', 'min'.",
        choices=("index", "mean", "sum", "max", "min"), why="unknown")
    score_head: str = option(
        "auto", "Module whose per-token output holds the scores, read at the mask's last token. 'auto': 'score', "
        "'v_head' or 'classifier'; 'none': the model's own pooled logits (picked by pad_token_id).",
        why="must be a module name", fix="use 'auto'")
    score_output_field: str | None = option(
        None, "Read the reward from this field of the model's output (ArmoRM-style RMs: 'score'), one value or one "
        "row of outputs per input (score_index / score_reduction pick one); checked at load.",
        str, optional=True, why="must be the name of a field of the model's output",
        fix="use e.g. 'score' (ArmoRM-style RMs), or leave it unset to read the score head")
    reward_kind: str = option(
        "outcome", "'outcome': one score per trajectory; 'process': a PRM scoring every step at a separator token "
        "(step_* and process_* keys); 'judge': a causal LM asked about the trajectory (judge_* keys); 'group_judge': "
        "a causal LM asked once about every response of a GRPO group, replying with a JSON number per response; "
        "'pairwise_judge': a causal LM asked which of two responses of a group is better, the group's comparisons "
        "turned into a reward per response (pair_* keys).",
        choices=("outcome", "process", "judge", "group_judge", "pairwise_judge"), why="unknown kind")
    judge_prompt: str | None = option(
        None, "Judges: Jinja with prompt, response, messages, ground_truth, the user turn of the judge's chat "
        "template (group judges: responses, the group's responses each in a block <response label='n'>, instead of "
        "response). None: a yes/no question (logits), a 0-10 grade ending 'Verdict: <n>' (generate), a 0-10 grade "
        "per label as a JSON object (group_judge).",
        str, optional=True, fix="write it in Jinja, e.g. 'Question: {{ prompt }} Answer: {{ response }} Correct?'")
    judge_readout: str | None = option(
        None, "Judges: 'logits' (one forward, read at the next token: judge_tokens) or 'generate' (greedy on "
        "vLLM, at most judge_max_tokens, parsed by judge_pattern; a pairwise judge's {\"winner\": ...}). None: "
        "'logits' (a group judge always writes).",
        str, optional=True, choices=("logits", "generate"), why="unknown readout")
    judge_tokens: tuple[str, ...] | None = option(
        None, "judge_readout='logits': next-token strings, one token each; two or more: the first one's probability "
        "among them; one: its raw logit. None: [Yes,No] (a pairwise judge: two, [A,B]).", tuple, optional=True,
        fix="e.g. +async_rm.judge_tokens='[Yes,No]'")
    judge_pattern: str | None = option(
        None, "judge_readout='generate': a regex with one group; its last match is the verdict, a number or one of "
        "judge_labels. None: 'Verdict:\\s*(-?[0-9]+(?:\\.[0-9]+)?)'.", str, optional=True,
        fix="e.g. +async_rm.judge_pattern='Verdict: *([0-9]+)'")
    judge_labels: tuple[tuple[str, float], ...] | None = option(
        None, "judge_readout='generate': label -> score for verdicts that are words (as written, then any case), e.g. "
        "{correct: 1, wrong: 0}. None: the verdict is a number.", dict, optional=True,
        fix="e.g. +async_rm.judge_labels='{correct:1,wrong:0}'")
    judge_max_tokens: int = option(256, "Judges that write (judge_readout='generate', group_judge): the most tokens "
                                   "the judge writes per call.",
                                   least=1, why="must be a positive integer", fix="set e.g. {key}=256")
    judge_scale: float = option(
        1.0, "group_judge: each response's score is the number the judge gives its label divided by this (10 turns a "
        "0-10 grade into 0-1).", above=0, fix="e.g. +{key}=10")
    judge_seed: int = option(
        0, "group_judge, pairwise_judge: with the group's id, seeds which response gets which label, or which pairs "
        "(pair_plan=random_k) and orders (pair_orders=one) are asked (the same in every run).",
        least=0, fix="use 0, or another non-negative integer")
    group_wait_s: float = option(
        300.0, "group_judge, pairwise_judge: a group is judged when its rollout.n responses have arrived, or with "
        "those that have "
        "when this long has passed since its last one arrived (a sibling whose agent loop failed is withdrawn at "
        "once; this wait is for one that is lost). "
        "Must exceed the longest gap between two siblings' ends and stay below request_timeout_s.",
        above=0, why="must be a positive number of seconds", fix="set e.g. {key}=300")
    pair_plan: str | None = option(
        None, "pairwise_judge: which pairs of a group are compared: 'all_pairs' (n(n-1)/2), 'circular' (each response "
        "with its next, n), 'random_k' (each with pair_k others). None: all_pairs up to 8 responses, else circular.",
        str, optional=True, choices=PLANS, why="unknown plan")
    pair_k: int | None = option(
        None, "pair_plan='random_k': how many others each response is compared with.", int, optional=True, least=1,
        fix="set e.g. {key}=3 with pair_plan=random_k")
    pair_orders: str = option(
        "both", "pairwise_judge: 'both' asks each pair as (a, b) and (b, a) and averages the two answers (a judge "
        "that prefers a position gains nothing); 'one' asks one order, chosen by judge_seed.", choices=ORDERS,
        why="unknown order")
    pair_aggregate: str = option(
        "win_rate", "pairwise_judge: a response's reward from its comparisons: 'win_rate' (its mean result, a tie "
        "0.5) or 'bradley_terry' (maximum-likelihood strengths scaled to [0, 1] within the group).",
        choices=("win_rate", "bradley_terry"), why="unknown aggregate")
    step_delimiter: str = option(
        "\n\n", "Process RMs: how the response splits into steps; '\\n' and '\\t' on the command line mean "
        "newline and tab.", fix="use the default '\\n\\n'")
    step_separator: str | None = option(
        None, "Process RMs (required): the token the PRM reads each step at, one token of its vocabulary (e.g. "
        "'<extra_0>' for Qwen2.5-Math-PRM).", str, optional=True)
    process_label_index: int = option(
        1, "Process RMs: the label whose probability at a separator is the step's score (1: 'correct').",
        least=0, why="must be a label index >= 0", fix="use 1 (the 'correct' label of Qwen2.5-Math-PRM)")
    process_reduction: str = option(
        "min", "Process RMs: 'min', 'mean', 'last' or 'product' of the step scores; 'none': token-level rewards, "
        "each step's score on the response token where it ends, their sum the trajectory's score.",
        choices=("min", "mean", "last", "product", "none"), why="unknown reduction")
    engine: str = option(
        "transformers", "What runs the forwards: 'transformers' or 'vllm' (a vLLM pooling engine in each replica, "
        "outcome "
        "RMs, tensor parallel over gpus_per_replica GPUs, checked against transformers at load). Judges that write "
        "run on vLLM.",
        choices=("transformers", "vllm"), why="unknown engine",
        fix="use 'transformers', or 'vllm' (checked against transformers at load)")
    micro_batch_max_tokens: int = option(
        16384, "Token budget of one forward: rows x longest row padded, real tokens packed (a shared prompt once).",
        least=1, why="must be a positive integer",
        fix="set a token budget such as 16384 (lower it if the RM runs out of memory)")
    packing: str = option(
        "auto", "'auto': packed forwards (rows as one sequence, no padding) where the RM's attention and a "
        "variable-length kernel allow it, checked at load, else padded; 'true': packed or fail at load; 'false'.",
        choices=("auto", "true", "false"), why="unknown mode",
        fix="use one of ('auto', 'true', 'false') ('auto' packs where it is safe)")
    share_prompts: str = option(
        "auto", "GRPO siblings in one packed forward run their common prefix once (scores unchanged, checked at "
        "load). 'auto': with a CUDA kernel (on CPU it is slower); 'true': any variable-length kernel; 'false'.",
        choices=("auto", "true", "false"), why="unknown mode")
    use_gpu: bool = option(True, "False: CPU replicas (tests, demo).")
    n_gpus_per_node: int = option(
        1, "GPUs (CPU bundles without GPUs) per node of the reward pool, gpus_per_replica per replica.",
        least=1, why="the reward pool needs at least one RM replica (GPU) per node", fix=_POOL_FIX)
    nnodes: int = option(1, "Nodes of the reward pool.", least=1, why="the reward pool needs at least one node",
                         fix=_POOL_FIX)
    gpus_per_replica: int = option(
        1, "GPUs of one replica, on one node (a divisor of n_gpus_per_node): an RM too large for one GPU is sharded "
        "(transformers, logits judges included: tensor parallel where the architecture has a plan, else FSDP2; "
        "engine='vllm' and judges that write their verdict: one vLLM engine, tensor parallel over the k GPUs).",
        least=1, why="a replica needs at least one GPU",
        fix="set {key}=1 (a full copy per GPU), or the GPUs one copy needs, e.g. 2 for a 70B RM on 80 GB GPUs")
    placement_timeout_s: float = option(300.0, "How long to wait for the reward pool's placement groups.", **_SECONDS)
    init_timeout_s: float = option(900.0, "How long a replica may take to load the RM (and a timed-out call may "
                                   "take to answer before its replica is replaced).", **_SECONDS)
    endpoint: tuple[str, ...] | None = option(
        None, "A remote RM: the base URL of an OpenAI-compatible server (http(s)://host:port/v1), or a list of them "
        "(least outstanding first, one that keeps failing set aside for a while). No replica is placed for it. "
        "Judges: chat completions; outcome RMs: vLLM's classify endpoint.", tuple, optional=True,
        fix="e.g. +async_rm.endpoint=http://10.0.0.5:8000/v1 or "
        "'+async_rm.endpoint=[http://a:8000/v1,http://b:8000/v1]'")
    endpoint_model: str | None = option(
        None, "A remote RM: the model to ask for. None: the first model the server lists at /v1/models.", str,
        optional=True)
    api_key_env: str | None = option(
        None, "A remote RM: the NAME of the environment variable that holds the API key (never the key itself); the "
        "key is sent only to the endpoint's own hosts.", str, optional=True,
        fix="e.g. +async_rm.api_key_env=OPENAI_API_KEY")
    max_concurrency: int | None = option(
        None, "A remote RM: most requests in flight at once, over the whole job. None: no bound.", int,
        optional=True, least=1, fix="set it to the most requests the endpoint should serve at once, e.g. 64")
    max_rpm: float | None = option(
        None, "A remote RM: most requests per minute over the whole job (every attempt counts). None: no limit.",
        float, optional=True, above=0, fix="set the provider's requests/min limit, e.g. 500")
    max_tpm: float | None = option(
        None, "A remote RM: most tokens per minute over the whole job (each request's prompt and max output "
        "tokens reserved, reconciled with the usage the server reports). None: no limit.", float, optional=True,
        above=0, fix="set the provider's tokens/min limit, e.g. 200000")
    attempt_timeout_s: float = option(
        300.0, "A remote RM: longest one HTTP attempt may take; past it the endpoint counts a failure and the request "
        "is retried (on another endpoint where there is one) within request_timeout_s.", **_SECONDS)
    max_retry_after_s: float = option(
        60.0, "A remote RM: the longest Retry-After honoured (a longer one is read as this).", least=0,
        fix="set e.g. {key}=60")
    judge_retries: int = option(
        0, "Judges that write (judge_readout='generate', group_judge): times a reply that does not read, or was cut "
        "at judge_max_tokens, is asked for again (its conversation with that reply and why it did not read added) "
        "before the trajectory, or the group, fails.", least=0, fix="use 0 (fail at once) or a small count such as 2")
    judge_temperature: float | None = option(
        0.0, "Judges that write: the sampling temperature (0: greedy, the same answer to the same conversation). "
        "None: none sent (the engine's or server's default; hosted reasoning models refuse a temperature).", float,
        optional=True, least=0, fix="use 0 (greedy), or None to send none")
    judge_request_extra: str | None = option(
        None, "A remote judge: a mapping merged into each chat-completions request's body, for what a provider "
        "needs (e.g. {reasoning_effort: low}); the verdict is read from the reply's content, never its reasoning.",
        object, optional=True, fix="e.g. '+async_rm.judge_request_extra={reasoning_effort: low}'")
    kind_given: bool = field(default=False, metadata={"internal": True, "help": (
        "Whether the user set reward_kind (a process RM's checkpoint is read as an outcome RM only if they did).")})
    placement: str = field(default="own_pool", metadata={"internal": True, "help": (
        "Where the replicas run (PLACEMENTS): 'own_pool', or 'policy_pool' (verl's actor/rollout pool, asleep while "
        "the policy trains); from reward.reward_model.enable_resource_pool.")})
    rollout_memory_utilization: float | None = field(default=None, metadata={"internal": True, "help": (
        "placement='policy_pool': verl's actor_rollout_ref.rollout.gpu_memory_utilization, for the memory check.")})
    actor_resident_bytes: int = field(default=0, metadata={"internal": True, "help": (
        "placement='policy_pool': bytes of the policy kept on each GPU while the rollout runs "
        "(scoring.colocation.actor_resident_bytes), for the memory check.")})

    def __post_init__(self) -> None:
        for name in ("packing", "share_prompts"):  # Hydra reads +async_rm.packing=true as a boolean
            if isinstance(getattr(self, name), bool):
                object.__setattr__(self, name, "true" if getattr(self, name) else "false")
        if isinstance(self.step_delimiter, str):  # a command line cannot carry a newline: '\\n', '\\t' mean them
            object.__setattr__(self, "step_delimiter", self.step_delimiter.replace("\\n", "\n").replace("\\t", "\t"))
        if isinstance(self.endpoint, str):  # one URL
            object.__setattr__(self, "endpoint", (self.endpoint,))
        check_options(self)
        if self.endpoint is None and not self.model_path:
            raise ConfigValueError("model_path", self.model_path, "the RM path is required (or an endpoint)",
                                   "set it to the RM's local directory, or +async_rm.endpoint to a server's URL")
        if self.retemplate != "never" and not self.policy_tokenizer_path:
            raise ConfigValueError(
                "policy_tokenizer_path", self.policy_tokenizer_path,
                "the policy tokenizer is needed to decode responses and to tell whether the RM can reuse token ids",
                "set it to the policy model's directory, or set retemplate='never' if the RM shares the policy's "
                "tokenizer and chat template")
        if self.score_output_field is not None and not self.score_output_field.isidentifier():
            raise ConfigValueError("score_output_field", self.score_output_field,
                                   "must be the name of a field of the model's output",
                                   "use e.g. 'score' (ArmoRM-style RMs), or leave it unset to read the score head")
        judge_key = next((k for k in _JUDGE_KEYS if getattr(self, k) is not None), None)
        if self.reward_kind not in JUDGE_KINDS and (key := judge_key) is not None:
            raise ConfigValueError(key, getattr(self, key), f"it is read only by judge RMs, and reward_kind is "
                                   f"{self.reward_kind!r}", "set reward_kind='judge', or remove the key")
        defaults = {f.name: f.default for f in fields(self)}
        if self.reward_kind not in JUDGE_KINDS and self.judge_temperature != defaults["judge_temperature"]:
            raise ConfigValueError("judge_temperature", self.judge_temperature, "it is read only by judges that write, "
                                   f"and reward_kind is {self.reward_kind!r}", "remove it")
        for keys, kinds in ((("judge_scale",), ("group_judge",)), (_GROUP_KEYS, GROUPED_KINDS),
                            (_PAIR_KEYS, ("pairwise_judge",))):
            if self.reward_kind not in kinds and (key := next((k for k in keys if getattr(self, k) != defaults[k]),
                                                              None)) is not None:
                raise ConfigValueError(key, getattr(self, key), f"it is read only by reward_kind "
                                       f"{' or '.join(kinds)}, and reward_kind is {self.reward_kind!r}",
                                       f"set reward_kind to {' or '.join(kinds)}, or remove the key")
        if self.judge_tokens is not None and len(set(self.judge_tokens)) < len(self.judge_tokens):
            raise ConfigValueError("judge_tokens", list(self.judge_tokens), "a token is listed twice: the readout "
                                   "would split its probability and score every response alike",
                                   "list each token once")
        if (self.pair_plan == "random_k") != (self.pair_k is not None):
            raise ConfigValueError("pair_k", self.pair_k, "it is the k of pair_plan=random_k, and goes with it only",
                                   "set both pair_plan=random_k and pair_k, or neither")
        if self.reward_kind in ("judge", "pairwise_judge") and self.judge_readout is None:
            object.__setattr__(self, "judge_readout", "logits")
        kind_class(self).check(self)
        if self.endpoint is not None:
            _check_remote(self)
        else:
            if (key := next((k for k in (*REMOTE_ONLY_KEYS, *_REMOTE_DEFAULTED) if getattr(self, k) is not None
                             and getattr(self, k) != defaults[k]), None)) is not None:
                raise ConfigValueError(key, getattr(self, key), "it only means something for an RM served at an "
                                       "endpoint, and this RM is loaded from model_path", "remove it, or set "
                                       "endpoint to the URL of the server that serves this RM")
            vllm_engine.check(self)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"RMConfig.placement={self.placement!r}: one of {PLACEMENTS}")
        if self.placement == "policy_pool" and self.gpus_per_replica > 1:
            raise ConfigValueError(
                "gpus_per_replica", self.gpus_per_replica, "with reward.reward_model.enable_resource_pool=False the "
                "RM shares the policy's GPUs, one replica on each of them; the plugin does not shard an RM across the "
                "policy's GPUs", "set gpus_per_replica=1, or give the RM its own pool "
                "(reward.reward_model.enable_resource_pool=True)")
        k, per_node = self.gpus_per_replica, self.n_gpus_per_node
        if per_node % k:
            node = "a node of the reward pool" if k < per_node else "a node"
            fits = [d for d in range(1, per_node + 1) if per_node % d == 0]
            raise ConfigValueError(
                "gpus_per_replica", k,
                f"a replica's GPUs are all on one node, and {node} has n_gpus_per_node={per_node} "
                f"(reward.reward_model.n_gpus_per_node, or async_rm.models.<name>.n_gpus_per_node), which is "
                f"{'smaller than' if k > per_node else 'not a multiple of'} gpus_per_replica",
                f"set n_gpus_per_node to a multiple of {k} (e.g. {k * max(1, -(-per_node // k))}), or {{key}} to "
                f"one of {fits}")

    @property
    def remote(self) -> bool:
        """True when a server elsewhere scores (``endpoint``): no replica, no pool."""
        return self.endpoint is not None

    @property
    def own_pool(self) -> bool:
        """True when the plugin places the replicas on a reward pool of their own."""
        return self.endpoint is None and self.placement == "own_pool"

    @property
    def sleeps(self) -> bool:
        """True when the replicas share the policy's GPUs and sleep while it trains."""
        return self.endpoint is None and self.placement == "policy_pool"

    @property
    def token_level(self) -> bool:
        """True when each step's score becomes a token-level reward (``reward_kind='process'``, no reduction)."""
        return self.reward_kind == "process" and self.process_reduction == "none"

    @property
    def writes(self) -> bool:
        """True for a judge that writes (``judge_readout='generate'``, or a group judge): vLLM generate in the replicas,
        chat completions at an endpoint."""
        return self.reward_kind == "group_judge" or (self.reward_kind in ("judge", "pairwise_judge")
                                                     and self.judge_readout == "generate")

    @property
    def grouped(self) -> bool:
        """True for a judge of a whole GRPO group (a group judge, a pairwise judge): its trajectories wait for their
        group."""
        return self.reward_kind in GROUPED_KINDS

    @property
    def on_vllm(self) -> bool:
        """True when the replicas run a vLLM engine (``engine='vllm'``, or a judge that writes)."""
        return self.engine == "vllm" or self.writes

    @property
    def replicas_per_node(self) -> int:
        return self.n_gpus_per_node // self.gpus_per_replica

    @property
    def num_replicas(self) -> int:
        """RM replicas in the pool (each runs one batch at a time), of ``gpus_per_replica`` GPUs each."""
        return self.replicas_per_node * self.nnodes


def kind_class(config: RMConfig) -> type[Kind]:
    """The kind of an RM: outcome, process, or a judge read at its next token or by the verdict it writes."""
    readout = config.judge_readout if config.reward_kind in ("judge", "pairwise_judge") else None
    return KINDS[(config.reward_kind, readout)]


#: Settings that only mean something for an RM the plugin loads, with their defaults: refused with ``endpoint``.
#: Keys of an RM served at an endpoint, refused for one the plugin loads (and the reverse below).
REMOTE_ONLY_KEYS = ("endpoint_model", "api_key_env", "max_concurrency", "max_rpm", "max_tpm", "judge_request_extra")
#: Keys of a remote RM that have a default: refused for a loaded RM when they differ from it.
_REMOTE_DEFAULTED = ("attempt_timeout_s", "max_retry_after_s")
LOADED_ONLY_KEYS = ("engine", "dtype", "attn_implementation", "micro_batch_max_tokens", "packing", "share_prompts",
                    "gpus_per_replica", "score_head", "score_output_field")


def _check_remote(config: RMConfig) -> None:
    """``endpoint``: the URLs checked, settings of a loaded RM refused, the limits able to send one request."""
    object.__setattr__(config, "endpoint", check_endpoints(config.endpoint, "endpoint"))
    defaults = {f.name: f.default for f in fields(config)}
    for key in LOADED_ONLY_KEYS:
        if getattr(config, key) != defaults[key]:
            raise ConfigValueError(key, getattr(config, key), "it only means something for an RM the plugin loads "
                                   "itself, and this RM is served at endpoint", "remove it (the server's own settings "
                                   "decide), or remove endpoint to load the RM from model_path")
    if config.trust_remote_code and not config.model_path:
        raise ConfigValueError("trust_remote_code", True, "it runs the code of the checkpoint at model_path, and this "
                               "RM served at endpoint has none here", "remove it, or set model_path to the checkpoint "
                               "the server serves")
    if config.retemplate == "never" and not config.model_path:
        raise ConfigValueError("retemplate", "never", "without the served checkpoint here (model_path) the server "
                               "renders the conversation itself", "remove it, or set model_path")
    if config.reward_kind == "process":
        raise ConfigValueError("reward_kind", "process", "a process RM is read at each step's separator token, which "
                               "no OpenAI-compatible API returns", "load it with the plugin's replicas (remove "
                               "endpoint), or use an outcome RM or a judge at the endpoint")
    if config.reward_kind == "judge" and config.judge_readout == "logits" and len(config.judge_tokens or ()) < 2:
        raise ConfigValueError("judge_tokens", config.judge_tokens, "a server returns log-probabilities, not the raw "
                               "logit one judge token is read by", "list two or more tokens, e.g. '[Yes,No]': the "
                               "first one's probability among them is the score")
    output = config.judge_max_tokens if config.writes else 1
    if config.max_tpm is not None and config.max_tpm < output + 1:
        raise ConfigValueError("max_tpm", config.max_tpm, f"one request reserves its input and its {output} output "
                               "token(s), more than a minute may send", f"raise max_tpm well above {output}, or "
                               "lower judge_max_tokens")
