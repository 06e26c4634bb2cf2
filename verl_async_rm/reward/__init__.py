"""The reward wrapper: verl reward manager ``async_rm`` that mixes the RM score with verl's rule-based score."""

from verl_async_rm.reward.combine import RM_SCORE_KEY, RewardMix

__all__ = ["RewardMix", "RM_SCORE_KEY"]
