"""``verl-async-rm doctor [OVERRIDE ...]``: given a ``main_ppo`` command's overrides, verl's real config is composed
and checked as a launch checks it before Ray starts (verl's ``validate_config``, then the plugin's checks), each
problem printed with its fix and exit status 1, or OK and 0; the devices are reported; verl's optional-engine
warnings stay out of the output. No Ray, no weights, no endpoint asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_async_rm import doctor
from verl_async_rm.integration import checks
from verl_async_rm.touch_points import Result, TOUCH_POINTS

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:Disabled critic as algorithm.adv_estimator:UserWarning")]

REPO_ROOT = Path(__file__).resolve().parents[2]

#: verl's usual GRPO on 8 GPUs (1024 prompts x 5 samples) with the README's opt-in pasted on: 6 policy GPUs
GRPO = ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"]


def opt_in(models, gpus: int = 6) -> list[str]:
    return [f"actor_rollout_ref.model.path={models.policy}", f"trainer.n_gpus_per_node={gpus}",
            "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager",
            "reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=2",
            "reward.reward_model.nnodes=1", f"reward.reward_model.model_path={models.rm}",
            "reward.reward_manager.name=async_rm"]


@pytest.fixture
def touch_points_ok(monkeypatch):
    """The touch points, checked by their own tests, stand as OK here."""
    monkeypatch.setattr(doctor.touch_points, "run_checks", lambda: [Result(p, "ok") for p in TOUCH_POINTS])


def test_batch_sizes_that_do_not_split_over_the_policys_gpus_get_numbers_that_do(tiny_models, touch_points_ok):
    """verl's validate_config asserts (AssertionError, not ValueError) that 1024 x 5 samples split over 6 GPUs."""
    status, text = doctor.report(overrides=[*GRPO, *opt_in(tiny_models)])
    assert status == 1, text
    problem = next(line for line in text.splitlines() if line.startswith("problem 1"))
    assert "verl's validate_config, AssertionError" in problem and "5120" in problem
    fix = text.splitlines()[text.splitlines().index(problem) + 1]
    assert "data.train_batch_size=1020 (1020 x 5 = 5100 = 850 x 6)" in fix
    assert text.splitlines()[-1] == "1 problem in the command"
    fixed = [o.replace("=1024", "=1020").replace("mini_batch_size=256", "mini_batch_size=60") for o in GRPO]
    status, text = doctor.report(overrides=[*fixed, *opt_in(tiny_models)])
    assert status == 0, text
    assert text.splitlines()[-1].startswith("the command: OK")


def test_the_same_job_on_8_gpus_with_the_rm_on_the_policys_gpus_is_ok(tiny_models, touch_points_ok):
    overrides = [o for o in opt_in(tiny_models, gpus=8) if "reward.reward_model.n" not in o]
    overrides = [o.replace("enable_resource_pool=True", "enable_resource_pool=False") for o in overrides]
    status, text = doctor.report(overrides=[*GRPO, *overrides])
    assert status == 0, text


def test_a_plugin_mistake_is_a_problem_with_its_fix(tiny_models, touch_points_ok):
    overrides = [*GRPO, *opt_in(tiny_models, gpus=8), "+async_rm.models.safety.model_path=/m",
                 "+async_rm.models.safety.placement=policy_pool"]
    status, text = doctor.report(overrides=overrides)
    assert status == 1
    assert "problem 1 (the plugin's checks, ValueError): unknown key async_rm.models.safety.placement=" in text
    status, text = doctor.report(overrides=[*GRPO, *opt_in(tiny_models, gpus=8), "reward.reward_model.enable=True"])
    assert status == 1 and "  fix: set reward.reward_model.enable=False" in text


def test_a_misspelt_verl_key_gets_the_declared_one(touch_points_ok):
    status, text = doctor.report(overrides=["reward.reward_modle.enable=False"])
    assert status == 1
    assert "problem 1 (Hydra, composing verl's config): Could not override 'reward.reward_modle.enable'" in text
    assert "fix: did you mean reward.reward_model.enable?" in text


def test_legacy_keys_are_checked_migrated_and_named(tiny_models, touch_points_ok):
    legacy = ["reward_model.enable_resource_pool=True", "reward_model.n_gpus_per_node=2", "reward_model.nnodes=1",
              f"reward_model.model.path={tiny_models.rm}", "reward_model.reward_manager=async_rm",
              "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager",
              f"actor_rollout_ref.model.path={tiny_models.policy}", "trainer.n_gpus_per_node=6"]
    fixed = [o.replace("=1024", "=1020").replace("mini_batch_size=256", "mini_batch_size=60") for o in GRPO]
    status, text = doctor.report(overrides=[*fixed, *legacy])
    assert status == 0, text
    assert "note: legacy keys" in text and "python -m verl_async_rm.main_ppo" in text


def test_an_endpoint_is_not_asked_and_a_missing_rm_path_is_a_warning(tiny_models, touch_points_ok, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the doctor asked an endpoint")

    monkeypatch.setattr(checks, "probe_endpoints", refuse)
    overrides = [*GRPO, *opt_in(tiny_models, gpus=8), "+async_rm.models.judge.endpoint=http://judge:8000/v1",
                 "+async_rm.models.judge.reward_kind=judge", "+async_rm.models.safety.model_path=/nowhere/rm"]
    status, text = doctor.report(overrides=overrides)
    assert status == 0, text
    assert "note: not asked: the endpoint(s) of judge at http://judge:8000/v1" in text
    assert "note: warning: RM safety's path /nowhere/rm is not a directory on this machine" in text


def test_the_devices_are_reported(touch_points_ok):
    found = doctor.environment()
    assert set(found) == {"CUDA", "vLLM build", "varlen kernel"}
    assert found["CUDA"].startswith(("available, ", "not available, 0 GPUs"))
    assert found["vLLM build"].startswith(("CPU build", "GPU build", "not installed"))
    assert found["varlen kernel"].split(":")[0] in ("flash_attn", "torch_varlen", "none")


def test_the_cli_keeps_verls_engine_warnings_out_and_exits_with_the_verdict(tiny_models):
    """The real command line, in a process of its own: verl's 'X engine is not available' warnings (printed on
    import) are not in its output; a problem gives exit status 1."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "verl_async_rm", "doctor", *GRPO, *opt_in(tiny_models)],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "engine is not available" not in result.stdout + result.stderr
    out = result.stdout.splitlines()
    assert [line.split()[0] for line in out[:10]] == ["verl-async-rm", "Python", "verl", "Ray", "torch",
                                                      "transformers", "vLLM", "CUDA", "vLLM", "varlen"]
    assert out[-1] == "1 problem in the command"


def test_a_manager_class_that_does_not_load_is_a_problem(tiny_models, touch_points_ok):
    # verl's task runner loads it only after Ray starts: the doctor loads it as verl does
    overrides = [*GRPO, *opt_in(tiny_models, gpus=8)]
    for wrong, says in [("verl_async_rm.AsyncRMAgentLoopManagr", "does not load"),
                        ("verl_async_rm.config.AsyncRMConfig", "is not the plugin's agent-loop manager")]:
        problems, _ = doctor.check_command([o.replace("verl_async_rm.AsyncRMAgentLoopManager", wrong)
                                            for o in overrides])
        assert [p.fix for p in problems if says in p.message] == [
            "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_async_rm.AsyncRMAgentLoopManager"]


def test_a_command_checked_twice_gets_its_warnings_twice(tiny_models, touch_points_ok):
    overrides = [*GRPO, *opt_in(tiny_models, gpus=8), "+async_rm.models.safety.model_path=/nowhere/rm"]
    notes = [doctor.check_command(overrides)[1] for _ in range(2)]
    assert notes[0] == notes[1] and any("/nowhere/rm is not a directory" in n for n in notes[1])


def test_hydras_config_flags_choose_the_config_as_main_ppo_reads_them(tmp_path):
    from omegaconf import OmegaConf

    megatron = doctor._compose(["--config-name", "ppo_megatron_trainer", "trainer.n_gpus_per_node=6"])
    assert megatron.actor_rollout_ref.actor.strategy == "megatron" and megatron.trainer.n_gpus_per_node == 6
    assert doctor._compose(["--config-path=config", "-cn=ppo_trainer.yaml"]).actor_rollout_ref.actor.strategy == "fsdp"
    (tmp_path / "mine.yaml").write_text(OmegaConf.to_yaml({"trainer": {"total_epochs": 3}}))
    assert doctor._compose([f"--config-path={tmp_path}", "--config-name=mine"]).trainer.total_epochs == 3


def test_the_cli_takes_hydras_flags_among_the_overrides(touch_points_ok, capsys):
    from verl_async_rm.cli import main as cli_main

    cli_main(["doctor", "--config-name=ppo_trainer", "trainer.n_gpus_per_node=6"])
    out = capsys.readouterr().out
    assert "the command" in out and "unrecognized arguments" not in out
