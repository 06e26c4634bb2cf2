"""Checks that the RM path holds a usable checkpoint, and its guarded loaders. The worst mistake caught here is
silent otherwise: ``AutoModelForSequenceClassification`` loads a causal LM with a randomly initialised score head
and only warns. :func:`check_rm_checkpoint` reads only ``config.json``, so the driver runs it before any GPU."""

from __future__ import annotations

import json
import os
from typing import Any

from verl_async_rm.errors import ConfigValueError, RewardModelError

__all__ = ["check_rm_checkpoint", "process_rm_signs", "load_tokenizer", "load_reward_model", "auto_class_name"]

#: Architecture name endings of generation models: such a checkpoint has no trained score head.
_GENERATION_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")
_TRUST_FIX = ("set trust_remote_code=True (verl: +async_rm.trust_remote_code=True), only if you trust the Python "
              "files in that directory")
_RM_FIX = ("point the RM path (verl: reward.reward_model.model_path) at a trained sequence-classification reward "
           "model, whose config.json lists an architecture such as Qwen2ForSequenceClassification")
_JUDGE_FIX = (f"{_RM_FIX}; or, to ask this causal LM about each trajectory and read its answer, make it a judge: "
              "+async_rm.reward_kind=judge (see the judge_* keys)")
#: Step tokens of published process RMs (Qwen2.5-Math-PRM: a score at each ``<extra_0>``), found among a checkpoint's
#: added tokens: with two labels, the sign of a process RM whatever its architecture is called.
_STEP_TOKENS = ("<extra_0>",)


def _read_config(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ConfigValueError("model_path", model_path, "no config.json in that directory, so it is not a "
                               "HuggingFace checkpoint", _RM_FIX)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigValueError("model_path", model_path, f"cannot read {path} ({err})", _RM_FIX) from None
    if not isinstance(config, dict):
        raise ConfigValueError("model_path", model_path, f"{path} does not hold a JSON object", _RM_FIX)
    return config


def process_rm_signs(config: dict[str, Any], model_path: str) -> tuple[list[str], str | None]:
    """What says that the checkpoint is a process RM (a score per step, not one per trajectory): a token-level or
    process-reward architecture, its label count, a step token among its added tokens; and that step token."""
    architectures = [str(a) for a in config.get("architectures") or []]
    auto_map = config.get("auto_map") or {}
    signs = []
    if any(a.endswith("ForTokenClassification") or "ProcessRewardModel" in a for a in architectures):
        signs.append(f"architectures={architectures}")
    if "AutoModelForTokenClassification" in auto_map and "AutoModelForSequenceClassification" not in auto_map:
        signs.append("its code maps AutoModelForTokenClassification only")
    # transformers writes no label map for its default of two labels
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    found: list[Any] = []  # the added (special) tokens its tokenizer files declare; none when they cannot be read
    for name in ("tokenizer_config.json", "tokenizer.json"):
        try:
            with open(os.path.join(model_path, name), encoding="utf-8") as f:
                files = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(files, dict):
            decoder = files.get("added_tokens_decoder") or {}
            found += [t.get("content") for t in [*decoder.values(), *(files.get("added_tokens") or ())]
                      if isinstance(t, dict)]
            found += list(files.get("additional_special_tokens") or ())
    added = {t for t in found if isinstance(t, str)}
    step = next((t for t in _STEP_TOKENS if t in added), None)
    if (signs or labels == 2) and step is not None:
        signs.append(f"{labels} labels and the step token {step!r}")
    elif signs:
        signs.append(f"{labels} labels")
    return signs, step


def check_rm_checkpoint(model_path: str, trust_remote_code: bool, reward_kind: str = "outcome",
                        kind_given: bool = False) -> None:
    """Raise ``ValueError`` if ``model_path`` cannot be an RM: no ``config.json``; a generation architecture with no
    reward head (a judge needs one instead); custom code without ``trust_remote_code`` for an unknown model type or an
    RM loaded by its own ``AutoModel`` code (transformers would load the bare backbone, dropping the reward head); a
    process RM read as an outcome RM without the user saying so (``kind_given``: ``reward_kind`` was set)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = _read_config(model_path)
    auto_map = config.get("auto_map") or {}
    model_type = config.get("model_type")
    own_model = auto_class_name(config, reward_kind) == "AutoModel"
    if auto_map and not trust_remote_code and (own_model or str(model_type) not in CONFIG_MAPPING_NAMES):
        raise ConfigValueError("trust_remote_code", False, f"the RM at {model_path} (model_type={model_type!r}) is "
                               f"defined by its own Python code (auto_map: {sorted(auto_map)}), which runs only with "
                               "trust_remote_code", _TRUST_FIX)
    architectures = [str(a) for a in config.get("architectures") or []]
    if reward_kind in ("judge", "group_judge", "pairwise_judge"):
        if architectures and not any(a.endswith(_GENERATION_HEADS[:3]) for a in architectures) and not (
            {"AutoModelForCausalLM", "AutoModelForImageTextToText"} & set(auto_map)
        ):
            raise ConfigValueError(
                "model_path", model_path, f"its config.json lists architectures={architectures}, not a causal LM, so "
                "it has no next-token output for a judge to read",
                "point it at a causal LM (e.g. an instruct model, or Llama-3.1-Nemotron-70B-Reward-HF), or set "
                "reward_kind='outcome' for a sequence-classification RM")
        return
    has_cls_code = bool({"AutoModelForSequenceClassification", "AutoModelForTokenClassification"} & set(auto_map))
    if architectures and not has_cls_code and not any("ForSequenceClassification" in a for a in architectures) \
            and all(a.endswith(_GENERATION_HEADS) for a in architectures):
        raise ConfigValueError("model_path", model_path, f"its config.json lists architectures={architectures}, a "
                               "generation model with no trained reward head (loading it as a sequence classifier "
                               "would score with a randomly initialised head)", _JUDGE_FIX)
    signs, step = process_rm_signs(config, model_path)
    if reward_kind == "outcome" and signs and not kind_given:
        raise ConfigValueError(
            "reward_kind", "outcome", f"the RM at {model_path} is a process RM ({'; '.join(signs)}): it scores each "
            "step, and read as an outcome RM its number at the last token means nothing",
            "score it as a process RM: +async_rm.reward_kind=process +async_rm.step_separator=" +
            (f"\"'{step}'\" (quoted for Hydra)" if step else "<its step token>") +
            "; or, if you know it is an outcome RM, say so: +async_rm.reward_kind=outcome")


def _refuse_remote_code(err: Exception, path: str, key: str, trust_remote_code: bool) -> None:
    """Raise the ``trust_remote_code`` error when ``err`` is transformers refusing ``path``'s own code."""
    if not trust_remote_code and "trust_remote_code" in str(err):
        raise ConfigValueError("trust_remote_code", False, f"{key}={path!r} holds custom code that transformers "
                               "refuses to run", _TRUST_FIX) from err


def load_tokenizer(path: str, key: str, trust_remote_code: bool) -> Any:
    """``AutoTokenizer.from_pretrained(path)``; a failure names ``key`` and the fix."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        _refuse_remote_code(err, path, key, trust_remote_code)
        raise ConfigValueError(
            key, path, f"cannot load a tokenizer from it ({type(err).__name__}: {err})",
            "point it at a directory holding the tokenizer files (tokenizer.json / tokenizer_config.json)") from err


def auto_class_name(config: dict[str, Any], reward_kind: str = "outcome") -> str:
    """The auto class that loads this RM: causal LM for judges; token (process) or sequence classification when the
    architecture or the checkpoint's code has it, else the checkpoint's own ``AutoModel`` code (InternLM2-Reward)."""
    auto_map = config.get("auto_map") or {}
    architectures = [str(a) for a in config.get("architectures") or []]
    if reward_kind in ("judge", "group_judge", "pairwise_judge"):
        return "AutoModelForCausalLM"
    wanted = "AutoModelForTokenClassification" if reward_kind == "process" else "AutoModelForSequenceClassification"
    suffix = "ForTokenClassification" if reward_kind == "process" else "ForSequenceClassification"
    if wanted in auto_map or any(a.endswith(suffix) for a in architectures):
        return wanted
    return "AutoModel" if "AutoModel" in auto_map else wanted


def load_reward_model(path: str, *, trust_remote_code: bool, attn_implementation: str, reward_kind: str = "outcome",
                      kind_given: bool = False, **kwargs: Any) -> Any:
    """The RM at ``path`` loaded with :func:`auto_class_name`'s class, refusing (``ValueError``) custom code without
    ``trust_remote_code``, a model type with no such class and a checkpoint that leaves parameters uninitialised; any
    other load failure is a ``RewardModelError``."""
    import transformers

    check_rm_checkpoint(path, trust_remote_code, reward_kind, kind_given)
    class_name = auto_class_name(_read_config(path), reward_kind)
    auto_class = getattr(transformers, class_name)
    try:
        model, info = auto_class.from_pretrained(path, trust_remote_code=trust_remote_code, output_loading_info=True,
                                                 attn_implementation=attn_implementation, **kwargs)
    except (ValueError, ImportError, OSError) as err:
        _refuse_remote_code(err, path, "model_path", trust_remote_code)
        if "Unrecognized configuration class" in str(err):
            what = "token-classification (process RM)" if reward_kind == "process" else "sequence-classification"
            raise ConfigValueError("model_path", path, f"transformers has no {what} class for its model type "
                                   f"({class_name})", _RM_FIX) from err
        raise RewardModelError(
            f"cannot load the RM from {path} with {class_name}, attn_implementation={attn_implementation!r}, "
            f"trust_remote_code={trust_remote_code}: {err}. Fix: try attn_implementation='eager'; set "
            "trust_remote_code=True only for an RM you trust") from err
    parameters = {name for name, _ in model.named_parameters()}
    missing = sorted(k for k in info.get("missing_keys") or () if k in parameters)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ConfigValueError("model_path", path, f"the checkpoint has no weights for {shown}, so "
                               f"{type(model).__name__} would score with randomly initialised parameters (a causal-LM "
                               "or base checkpoint given as the RM?)", _RM_FIX)
    return model
