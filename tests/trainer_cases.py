"""Shared set-up of the trainer-level tests: verl's real v1 ``PPOTrainer`` on CPU, built as ``python -m
verl.trainer.main_ppo`` builds it (:class:`verl_async_rm.testing.trainer_run.TrainerRun`), with verl's vLLM rollout,
FSDP2 actor, reference model and weight sync, and the plugin opted in as the README says.

Each module that uses :func:`running_trainer` gets a Ray cluster of its own (logical GPUs for verl's pools) and shuts
it down; such modules are marked ``own_cluster`` and run after every module of the session's shared clusters.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from conftest import REPO_ROOT, TEST_ASSETS, ray_runtime_env, stop_ray

RULE = str(TEST_ASSETS / "rule.py")
RM_W, RULE_W = 2.0, 0.5
#: Prompts per step and responses per prompt of the trainer tests (GRPO groups of N).
PROMPTS, N = 4, 2


def write_prompts(path: Path, questions: list[str], agent_names: list[str] | None = None) -> Path:
    """A parquet file of ``questions`` in verl's RL dataset format (as the demo's), each with its ``agent_name``
    (verl's ``RLHFDataset`` passes the column on, and the agent-loop worker runs that loop for the prompt)."""
    import pandas as pd

    from verl_async_rm.demo.data import DATA_SOURCE

    rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"split": "train", "index": i},
             **({"agent_name": agent_names[i]} if agent_names else {})} for i, q in enumerate(questions)]
    pd.DataFrame(rows).to_parquet(path)
    return path


def compose(overrides: list[str]):
    """verl's ``ppo_trainer`` config with ``overrides``, as ``verl.trainer.main_ppo``'s ``@hydra.main`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_async_rm.testing.trainer_config import verl_config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return hydra_compose(config_name="ppo_trainer", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def trainer_overrides(assets, *extra: str, rm_path=None, steps: int = 3, rm_gpus: int = 1,
                      trainer_mode: str = "sync", short_poll: bool = True) -> list[str]:
    """The CPU trainer's overrides, the README's opt-in (RM on a pool of ``rm_gpus`` of its own), the tests' rule
    and weights, ``steps`` training steps on ``PROMPTS`` x ``N`` trajectories of verl's ``trainer_mode``, its replay
    buffer polling every 50 ms (``short_poll``; else verl's own sampler); ``extra`` overrides go last (Hydra: the
    last value of a key wins)."""
    from verl_async_rm.testing.cpu_trainer import cpu_trainer_overrides, plugin_overrides
    from verl_async_rm.testing.replay_buffer import short_poll_overrides

    base = cpu_trainer_overrides(policy_path=str(assets.policy), train_files=str(assets.train_file),
                                 val_files=str(assets.val_file), train_batch_size=PROMPTS, rollout_n=N,
                                 max_response_length=24, rm_gpus=rm_gpus)
    plugin = plugin_overrides(str(rm_path or assets.rm), rm_gpus=rm_gpus, extra=[
        f"reward.custom_reward_function.path={RULE}",
        f"+async_rm.rm_weight={RM_W}",
        f"+async_rm.rule_weight={RULE_W}",
        "+async_rm.max_wait_ms=50",
        "+async_rm.placement_timeout_s=120",
    ])
    run = [f"trainer.v1.trainer_mode={trainer_mode}", f"trainer.total_training_steps={steps}",
           "trainer.logger=[console,file]", "trainer.resume_mode=disable",
           "trainer.val_before_train=False", "data.shuffle=False", "trainer.project_name=verl_async_rm_tests",
           # a cluster of the run's own, as main_ppo starts: ray.init() with no address would join a cluster another
           # test process started with ray.cluster_utils (test_rm_multinode.py), were one up at that moment
           "+ray_kwargs.ray_init.address=local"]
    return base + plugin + (short_poll_overrides(trainer_mode) if short_poll else []) + run + list(extra)


@contextlib.contextmanager
def running_trainer(config, metrics_file: Path):
    """A Ray cluster of this module's own, verl's trainer and the plugin's manager built on it
    (:class:`~verl_async_rm.testing.trainer_run.TrainerRun`); verl's ``Tracking`` writes its metrics to
    ``metrics_file`` (verl's file logger). Shut down on exit."""
    import ray

    from verl_async_rm.testing.cpu_trainer import cpu_env
    from verl_async_rm.testing.trainer_run import TrainerRun, init_ray

    if ray.is_initialized():  # the session's CPU-only cluster: verl's pools need logical GPUs
        stop_ray()
    os.environ.update({k: v for k, v in cpu_env().items() if k not in os.environ})
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics_file)
    env = ray_runtime_env()["env_vars"]
    init_ray(config, env_vars=env, namespace="verl_async_rm_trainer_tests")
    run = TrainerRun(config)
    try:
        run.start()
        yield run
    finally:
        try:
            run.close()
        finally:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
            ray.shutdown()


def logged_metrics(metrics_file: Path) -> dict[tuple[int, str], float]:
    """``{(step, key): value}`` of what verl's ``Tracking`` wrote through its file logger."""
    import json

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return {(row["step"], key): value for row in rows for key, value in row["data"].items()}


def rm_reference(rm_path, policy_path):
    """``score(raw_prompt, response_ids)``: the RM's own forward in plain transformers, fp32, on the conversation
    rendered with the RM's own chat template (the prompt's messages and the response decoded by the policy's
    tokenizer, trailing EOS/pad stripped), as a user would score one trajectory by hand."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy_tok, rm_tok = AutoTokenizer.from_pretrained(policy_path), AutoTokenizer.from_pretrained(rm_path)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    stop = {policy_tok.eos_token_id, policy_tok.pad_token_id}

    def score(raw_prompt, response_ids) -> float:
        ids = list(response_ids)
        while ids and ids[-1] in stop:
            ids.pop()
        text = rm_tok.apply_chat_template(
            [*raw_prompt, {"role": "assistant", "content": policy_tok.decode(ids)}], tokenize=False)
        tokens = rm_tok(text, add_special_tokens=False)["input_ids"]
        if rm_tok.bos_token_id is not None and tokens[:2] == [rm_tok.bos_token_id] * 2:
            tokens = tokens[1:]  # the template writes BOS; the tokenizer does not add another
        with torch.no_grad():
            return float(rm(input_ids=torch.tensor([tokens])).logits[0, 0])

    return score


def rule_reference(policy_path):
    """The tests' rule (``assets/rule.py``) on a response as verl's reward manager decodes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_path)
    return lambda response_ids: (len(tok.decode(response_ids, skip_special_tokens=True)) % 7) / 7.0


def policy_log_probs(policy_path):
    """``log_probs(prompt_ids, response_ids)``: the initial policy's log-prob of each response token (plain
    transformers, fp32, temperature 1), to compare with the actor's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()

    def log_probs(prompt_ids, response_ids) -> list[float]:
        ids = torch.tensor([[*prompt_ids, *response_ids]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0].tolist()

    return log_probs


def grpo_advantages(rewards: list[float], groups: dict[str, list[int]]) -> list[float]:
    """verl's GRPO outcome advantage by hand: (reward - group mean) / (group std + 1e-6), std unbiased (a group of
    one: mean 0, std 1)."""
    import torch

    out = [0.0] * len(rewards)
    for members in groups.values():
        scores = torch.tensor([rewards[i] for i in members], dtype=torch.float32)
        mean = scores.mean() if len(members) > 1 else torch.tensor(0.0)
        std = scores.std() if len(members) > 1 else torch.tensor(1.0)
        for i, value in zip(members, ((scores - mean) / (std + 1e-6)).tolist(), strict=True):
            out[i] = value
    return out


__all__ = ["N", "PROMPTS", "REPO_ROOT", "RM_W", "RULE", "RULE_W", "compose", "grpo_advantages", "logged_metrics",
           "policy_log_probs", "rm_reference", "rule_reference", "running_trainer", "trainer_overrides",
           "write_prompts"]
