"""Settings of the reward-model worker group, and their conversion from verl's config.

:class:`RMConfig` is the only thing the RM worker group receives: a typed dataclass, validated in ``__post_init__``.
:func:`rm_config_from_verl` reads verl's ``DictConfig`` once, at the boundary. Where a legacy top-level key is set
(not null) it wins, as in verl's own ``migrate_legacy_reward_impl``:

- ``model_path``: ``reward_model.model.path`` (legacy), else ``reward.reward_model.model_path``;
- ``n_gpus_per_node``, ``nnodes``: ``reward_model.<key>`` (legacy), else ``reward.reward_model.<key>``;
- ``trust_remote_code``: ``reward_model.model.trust_remote_code`` (legacy; verl 0.9.1 has no new key for it);
- ``policy_tokenizer_path``: ``actor_rollout_ref.model.tokenizer_path``, else ``actor_rollout_ref.model.path``;
- ``use_gpu``: ``trainer.device != "cpu"``.

With ``use_gpu``, ``reward.reward_model.enable_resource_pool`` (or the legacy key) must be True: otherwise verl
reserves no GPUs for the reward pool and overwrites its size with the trainer's.

Every other field comes from ``overrides`` (a mapping of RMConfig field names; the verl integration passes its own
section of the config there) or keeps its default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RMConfig", "ConfigValueError", "rm_config_from_verl"]

_DTYPES = ("auto", "bfloat16", "float16", "float32")
_RETEMPLATE = ("auto", "always", "never")
_REDUCTIONS = ("index", "mean", "sum", "max", "min")
_PACKING = ("auto", "true", "false")
_REWARD_KINDS = ("outcome", "process")
_PROCESS_REDUCTIONS = ("min", "mean", "last", "product", "none")


class ConfigValueError(ValueError):
    """Raised when a setting has a bad value; the message names the key, the value and the fix.

    ``key``, ``value`` and ``fix`` are kept as attributes so a caller that read the value from another place (a verl
    key) can re-raise the same error under that key's name.
    """

    def __init__(self, key: str, value: Any, why: str, fix: str) -> None:
        self.key, self.value, self.why, self.fix = key, value, why, fix
        super().__init__(f"{key}={value!r}: {why}. Fix: {fix.replace('{key}', key)}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray and multiprocessing rebuild exceptions from their pickle: keep all four parts (``args`` holds only the
        # message), so the error an RM replica raises reaches the driver intact.
        return (type(self), (self.key, self.value, self.why, self.fix))

    def renamed(self, key: str) -> ConfigValueError:
        """The same error, reported under ``key`` (for example the verl key the value came from)."""
        return ConfigValueError(key, self.value, self.why, self.fix)


@dataclass(frozen=True)
class RMConfig:
    """How to load, feed and place the reward model (RM) worker group."""

    model_path: str = field(
        default="",
        metadata={"help": "Local directory of a HuggingFace sequence-classification RM (config, weights, tokenizer)."},
    )
    policy_tokenizer_path: str | None = field(
        default=None,
        metadata={
            "help": "Local directory of the policy's tokenizer, used to decode responses when the RM's tokenizer or "
            "chat template differs from the policy's. Required unless retemplate='never'."
        },
    )
    retemplate: str = field(
        default="auto",
        metadata={
            "help": "'auto': re-render the conversation with the RM's chat template only when the RM's tokenizer or "
            "template differs from the policy's, else reuse the token ids; 'always'; 'never' (reuse the ids)."
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Weights dtype: 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16', 'float16', 'float32'."},
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={
            "help": "HF attention implementation: 'sdpa', 'eager', 'flash_attention_2', ... Packed forwards with a "
            "variable-length kernel (see packing) replace it with the plugin's own attention function."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Run the model repository's own Python code (RM and policy tokenizer). Only for code you trust."
        },
    )
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest RM input in tokens. Longer inputs keep their end (the response) and lose the start of "
            "the prompt. None: the model's max_position_embeddings."
        },
    )
    score_index: int = field(
        default=0,
        metadata={"help": "Which output of a multi-output head is the reward (Python indexing, -1 is the last)."},
    )
    score_reduction: str = field(
        default="index",
        metadata={"help": "'index' (use score_index) or a reduction over all outputs: 'mean', 'sum', 'max', 'min'."},
    )
    score_head: str = field(
        default="auto",
        metadata={
            "help": "Module whose per-token output holds the scores; the score is read at the last token of the "
            "attention mask. 'auto' tries 'score', 'v_head', 'classifier'; 'none' uses the model's own pooled "
            "logits (which decoder RMs pick by pad_token_id)."
        },
    )
    score_output_field: str | None = field(
        default=None,
        metadata={
            "help": "Read the reward from this field of the model's output (e.g. 'score' for ArmoRM-style "
            "multi-objective RMs whose forward returns a custom output), one value per row or one row of outputs "
            "(then score_index / score_reduction pick one). Checked on a one-row forward at load. None: the score "
            "head's per-token output (see score_head)."
        },
    )
    reward_kind: str = field(
        default="outcome",
        metadata={
            "help": "'outcome': one score per trajectory; 'process': a process RM (PRM) that scores every reasoning "
            "step at a separator token (token classification, e.g. Qwen2.5-Math-PRM); see the step_* and process_* "
            "keys."
        },
    )
    step_delimiter: str = field(
        default="\n\n",
        metadata={
            "help": "reward_kind='process': how the response text splits into steps (empty steps are skipped); "
            "'\\n' and '\\t' written on the command line mean newline and tab."
        },
    )
    step_separator: str | None = field(
        default=None,
        metadata={
            "help": "reward_kind='process': the token the PRM expects after each step (e.g. '<extra_0>' for "
            "Qwen2.5-Math-PRM); it must be one token of the RM's vocabulary. Required for process RMs."
        },
    )
    process_label_index: int = field(
        default=1,
        metadata={"help": "reward_kind='process': the label whose probability (softmax over the labels at each "
                          "separator) is the step's score (1: 'correct' for Qwen2.5-Math-PRM)."},
    )
    process_reduction: str = field(
        default="min",
        metadata={
            "help": "reward_kind='process': 'min', 'mean', 'last' or 'product' of the step scores give one outcome "
            "score per trajectory; 'none' gives token-level rewards: each step's score on the response token where "
            "that step ends (verl's rm_scores), their sum as the trajectory's score."
        },
    )
    micro_batch_max_tokens: int = field(
        default=16384,
        metadata={
            "help": "Token budget of one forward pass: rows x longest row when padded, the rows' real tokens when "
            "packed (a shared prompt counted once). A longer single input runs alone."
        },
    )
    packing: str = field(
        default="auto",
        metadata={
            "help": "'auto': packed forwards (a micro-batch's rows as one sequence, no padding, attention kept in "
            "each row) where the RM's attention allows it and a variable-length kernel exists (CUDA with "
            "flash-attn or torch's varlen_attn; CPU), checked against padded scores at load, else padded; 'true': "
            "packed whenever the model allows it, or fail at load; 'false': always padded."
        },
    )
    share_prompts: str = field(
        default="auto",
        metadata={
            "help": "Sibling trajectories (GRPO responses to one prompt: same uid before the last '/') in one packed "
            "micro-batch run their longest common prefix of RM tokens once, and each response attends to its keys "
            "and values; scores are unchanged (checked at load). 'auto': with a CUDA variable-length kernel (on "
            "CPU the padded attention makes it slower); 'true': with any variable-length kernel, CPU included; "
            "'false': never."
        },
    )
    use_gpu: bool = field(default=True, metadata={"help": "False: CPU replicas (tests, demo)."})
    n_gpus_per_node: int = field(
        default=1,
        metadata={"help": "GPUs per node of the reward pool (CPU bundles with use_gpu=False); each replica holds "
                          "gpus_per_replica of them (default: a full copy of the RM on each GPU)."},
    )
    nnodes: int = field(default=1, metadata={"help": "Nodes of the reward pool; each gets n_gpus_per_node GPUs."})
    gpus_per_replica: int = field(
        default=1,
        metadata={
            "help": "GPUs of one RM replica, all on one node (it must divide n_gpus_per_node): an RM too large for "
            "one GPU is sharded over them (tensor parallel where the architecture has a plan, else FSDP2); the "
            "pool holds n_gpus_per_node * nnodes / gpus_per_replica replicas."
        },
    )
    placement_timeout_s: float = field(
        default=300.0, metadata={"help": "How long to wait for the reward pool's placement groups."}
    )
    init_timeout_s: float = field(default=900.0, metadata={"help": "How long a replica may take to load the RM."})

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ConfigValueError(
                "model_path", self.model_path, "the RM path is required", "set it to the RM's local directory"
            )
        if self.retemplate not in _RETEMPLATE:
            raise ConfigValueError("retemplate", self.retemplate, "unknown mode", f"use one of {_RETEMPLATE}")
        if self.retemplate != "never" and not self.policy_tokenizer_path:
            raise ConfigValueError(
                "policy_tokenizer_path",
                self.policy_tokenizer_path,
                "the policy tokenizer is needed to decode responses and to tell whether the RM can reuse token ids",
                "set it to the policy model's directory, or set retemplate='never' if the RM shares the policy's "
                "tokenizer and chat template",
            )
        if self.dtype not in _DTYPES:
            raise ConfigValueError("dtype", self.dtype, "unknown dtype", f"use one of {_DTYPES}")
        if not isinstance(self.attn_implementation, str) or not self.attn_implementation:
            raise ConfigValueError(
                "attn_implementation", self.attn_implementation, "must be a non-empty string", "use 'sdpa' or 'eager'"
            )
        if self.max_length is not None and (_not_int(self.max_length) or self.max_length < 2):
            raise ConfigValueError(
                "max_length", self.max_length, "must be an integer >= 2 or None", "set a token count such as 4096"
            )
        if _not_int(self.score_index):
            raise ConfigValueError("score_index", self.score_index, "must be an integer", "use 0 for one-output RMs")
        if self.score_reduction not in _REDUCTIONS:
            raise ConfigValueError("score_reduction", self.score_reduction, "unknown", f"use one of {_REDUCTIONS}")
        if not isinstance(self.score_head, str) or not self.score_head:
            raise ConfigValueError("score_head", self.score_head, "must be a module name", "use 'auto'")
        if isinstance(self.packing, bool):  # Hydra reads +async_rm.packing=true as a boolean
            object.__setattr__(self, "packing", "true" if self.packing else "false")
        if self.packing not in _PACKING:
            raise ConfigValueError(
                "packing", self.packing, "unknown mode", f"use one of {_PACKING} ('auto' packs where it is safe)"
            )
        if isinstance(self.share_prompts, bool):  # Hydra reads +async_rm.share_prompts=true as a boolean
            object.__setattr__(self, "share_prompts", "true" if self.share_prompts else "false")
        if self.share_prompts not in _PACKING:
            raise ConfigValueError("share_prompts", self.share_prompts, "unknown mode", f"use one of {_PACKING}")
        self._check_reward_kind()
        if _not_int(self.micro_batch_max_tokens) or self.micro_batch_max_tokens <= 0:
            raise ConfigValueError(
                "micro_batch_max_tokens",
                self.micro_batch_max_tokens,
                "must be a positive integer",
                "set a token budget such as 16384 (lower it if the RM runs out of memory)",
            )
        for name in ("n_gpus_per_node", "nnodes"):
            value = getattr(self, name)
            if _not_int(value) or value <= 0:
                what = "one RM replica (GPU) per node" if name == "n_gpus_per_node" else "one node"
                raise ConfigValueError(
                    name,
                    value,
                    f"the reward pool needs at least {what}",
                    "set {key} to a positive integer (one RM replica on one GPU: n_gpus_per_node=1, nnodes=1)",
                )
        self._check_gpus_per_replica()
        for name in ("placement_timeout_s", "init_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigValueError(name, value, "must be a positive number of seconds", "set {key}=300")

    @property
    def token_level(self) -> bool:
        """True when each step's score becomes a token-level reward (``reward_kind='process'``, no reduction)."""
        return self.reward_kind == "process" and self.process_reduction == "none"

    def _check_reward_kind(self) -> None:
        if self.score_output_field is not None and (
            not isinstance(self.score_output_field, str) or not self.score_output_field.isidentifier()
        ):
            raise ConfigValueError(
                "score_output_field", self.score_output_field, "must be the name of a field of the model's output",
                "use e.g. 'score' (ArmoRM-style RMs), or leave it unset to read the score head",
            )
        if self.reward_kind not in _REWARD_KINDS:
            raise ConfigValueError("reward_kind", self.reward_kind, "unknown kind", f"use one of {_REWARD_KINDS}")
        if self.process_reduction not in _PROCESS_REDUCTIONS:
            raise ConfigValueError(
                "process_reduction", self.process_reduction, "unknown reduction", f"use one of {_PROCESS_REDUCTIONS}"
            )
        if _not_int(self.process_label_index) or self.process_label_index < 0:
            raise ConfigValueError(
                "process_label_index", self.process_label_index, "must be a label index >= 0",
                "use 1 (the 'correct' label of Qwen2.5-Math-PRM)",
            )
        if isinstance(self.step_delimiter, str) and "\\" in self.step_delimiter:
            # a command line cannot carry a newline: '\\n' and '\\t' written there mean newline and tab
            unescaped = self.step_delimiter.replace("\\n", "\n").replace("\\t", "\t")
            object.__setattr__(self, "step_delimiter", unescaped)
        if not isinstance(self.step_delimiter, str) or not self.step_delimiter:
            raise ConfigValueError(
                "step_delimiter", self.step_delimiter, "must be a non-empty string", "use the default '\\n\\n'"
            )
        if self.reward_kind != "process":
            return
        if not isinstance(self.step_separator, str) or not self.step_separator:
            raise ConfigValueError(
                "step_separator", self.step_separator, "a process RM needs the token it reads each step's score at",
                "set it to the PRM's step token, e.g. +async_rm.step_separator='<extra_0>' for Qwen2.5-Math-PRM",
            )
        if self.retemplate == "never":
            raise ConfigValueError(
                "retemplate", "never", "a process RM's input is always re-rendered, with a separator after each step",
                "use retemplate='auto' (the default)",
            )
        if self.score_output_field is not None:
            raise ConfigValueError(
                "score_output_field", self.score_output_field,
                "a process RM is read from its per-token logits at each step separator, not from an output field",
                "remove score_output_field, or set reward_kind='outcome'",
            )

    def _check_gpus_per_replica(self) -> None:
        k, per_node = self.gpus_per_replica, self.n_gpus_per_node
        if _not_int(k) or k <= 0:
            raise ConfigValueError(
                "gpus_per_replica", k, "a replica needs at least one GPU",
                "set {key}=1 (a full copy of the RM per GPU), or the GPUs one copy needs, e.g. 2 for a 70B RM on "
                "80 GB GPUs",
            )
        if per_node % k:
            node = "a node of the reward pool" if k < per_node else "a node"
            fits = [d for d in range(1, per_node + 1) if per_node % d == 0]
            raise ConfigValueError(
                "gpus_per_replica", k,
                f"a replica's GPUs are all on one node, and {node} has n_gpus_per_node={per_node} "
                f"(reward.reward_model.n_gpus_per_node, or async_rm.models.<name>.n_gpus_per_node), which is "
                f"{'smaller than' if k > per_node else 'not a multiple of'} gpus_per_replica",
                f"set n_gpus_per_node to a multiple of {k} (e.g. {k * max(1, -(-per_node // k))}), or {{key}} to "
                f"one of {fits}",
            )

    @property
    def replicas_per_node(self) -> int:
        """RM replicas on each node of the pool."""
        return self.n_gpus_per_node // self.gpus_per_replica

    @property
    def num_replicas(self) -> int:
        """RM replicas in the pool (one executor slot each), of ``gpus_per_replica`` GPUs each."""
        return self.replicas_per_node * self.nnodes


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _select(config: Any, key: str) -> Any:
    """``config[key]`` for a dotted key, or None when any part is missing (a ``DictConfig`` or nested mappings)."""
    # omegaconf is imported here, not at the top: the scorer (and `bench rm`) import RMConfig where it is absent.
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        return OmegaConf.select(config, key, default=None)
    node = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _first_set(config: Any, *keys: str) -> tuple[Any, str | None]:
    """The first of ``keys`` whose value is not None, with the key it came from."""
    for key in keys:
        value = _select(config, key)
        if value is not None:
            return value, key
    return None, None


def rm_config_from_verl(config: Any, overrides: Mapping[str, Any] | None = None, overrides_key: str = "") -> RMConfig:
    """Build :class:`RMConfig` from verl's trainer config (a ``DictConfig`` or nested mappings).

    Args:
        config: verl's whole config; only the keys in the module docstring's table are read.
        overrides: RMConfig fields to set (they win over values read from ``config``), for example the plugin's own
            section of the config. Unknown names raise ``ValueError``.
        overrides_key: where ``overrides`` came from (for example ``"async_rm.rm"``), used to name keys in errors.

    Raises:
        ValueError: a value is missing or bad; the message names the verl key it was read from and the fix.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(name: str, *keys: str) -> None:
        value, key = _first_set(config, *keys)
        if key is not None:
            values[name], sources[name] = value, key

    take("model_path", "reward_model.model.path", "reward.reward_model.model_path")
    take("n_gpus_per_node", "reward_model.n_gpus_per_node", "reward.reward_model.n_gpus_per_node")
    take("nnodes", "reward_model.nnodes", "reward.reward_model.nnodes")
    take("trust_remote_code", "reward_model.model.trust_remote_code")
    take("policy_tokenizer_path", "actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path")
    device = _select(config, "trainer.device")
    if device is not None:
        values["use_gpu"], sources["use_gpu"] = str(device) != "cpu", "trainer.device"

    known = {f.name for f in dataclasses.fields(RMConfig)}
    prefix = f"{overrides_key}." if overrides_key else ""
    for name, value in dict(overrides or {}).items():
        if name not in known:
            raise ConfigValueError(
                f"{prefix}{name}", value, "not a setting of the RM worker group", f"use one of {sorted(known)}"
            )
        values[name], sources[name] = value, f"{prefix}{name}"

    if "model_path" not in values:
        raise ConfigValueError(
            "reward.reward_model.model_path",
            None,
            "the RM worker group needs a reward model",
            "set reward.reward_model.model_path=/path/to/rm (legacy: reward_model.model.path)",
        )
    enable_pool, pool_key = _first_set(
        config, "reward_model.enable_resource_pool", "reward.reward_model.enable_resource_pool"
    )
    if values.get("use_gpu", True) and pool_key is not None and not enable_pool:
        raise ConfigValueError(
            pool_key,
            enable_pool,
            "the RM worker group runs on its own GPUs, and verl reserves them only with a separate reward pool "
            "(without it verl overwrites reward.reward_model.n_gpus_per_node/nnodes with the trainer's)",
            f"set {pool_key}=True and reward.reward_model.n_gpus_per_node / nnodes to the RM's GPUs",
        )
    try:
        return RMConfig(**values)
    except ConfigValueError as err:
        raise err.renamed(sources.get(err.key, err.key)) from None
