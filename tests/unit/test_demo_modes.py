"""The demo's settings and modes: each mode's ``main_ppo`` command composes against verl's own config and passes
verl's checks (and the plugin's where it opts in), every mode trains the same thing (data, seeds, steps, sizes), and
only the reward differs; the agent loop's lengths are a function of the seed and the prompt. No Ray, no verl run."""

from __future__ import annotations

import pytest

from verl_async_rm.demo.modes import mode_overrides
from verl_async_rm.demo.options import ALL_MODES, DEFAULT_MODES, DemoConfig

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:Disabled critic as algorithm.adv_estimator:UserWarning")]


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """``{mode: (overrides, composed config)}`` for every mode, with paths that need not exist."""
    from types import SimpleNamespace

    from test_recipes import compose

    folder = tmp_path_factory.mktemp("modes")
    assets = SimpleNamespace(policy=folder / "policy", rm=folder / "rm", train_file=folder / "train.parquet",
                             val_file=folder / "val.parquet")
    config = DemoConfig(modes="all")
    out = {}
    for mode in config.mode_list():
        overrides = mode_overrides(mode, config, assets, agent_loops=folder / "loops.yaml",
                                   record_path=folder / mode / "t.jsonl", ray_temp_dir="/tmp/vardX")
        out[mode] = (overrides, compose(overrides))
    return out


def test_every_mode_passes_verls_checks_and_the_plugin_modes_the_plugins(commands):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_async_rm.integration.checks import check_verl_config

    assert set(commands) == set(ALL_MODES)
    for mode, (_, config) in commands.items():
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        manager = config.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
        if mode.startswith("plugin"):
            settings = check_verl_config(config)
            assert manager == "verl_async_rm.AsyncRMAgentLoopManager"
            assert settings.mix.rm_weight == 1.0 and settings.mix.rule_weight == 0.0
            assert settings.rm.placement == ("policy_pool" if mode == "plugin_colocated" else "own_pool")
        else:
            assert manager is None  # verl's own agent-loop manager


def test_only_the_reward_differs_between_the_modes(commands):
    from omegaconf import OmegaConf

    def training(config) -> dict:
        c = OmegaConf.to_container(config, resolve=False)
        return {"data": c["data"], "actor": c["actor_rollout_ref"]["actor"], "rollout_n": c["actor_rollout_ref"][
            "rollout"]["n"], "seed": c["actor_rollout_ref"]["rollout"]["seed"], "agent": c["actor_rollout_ref"][
            "rollout"]["agent"]["default_agent_loop"], "steps": c["trainer"]["total_training_steps"],
            "sampler": c["trainer"]["v1"]["sampler"]["custom_sampler"], "mode": c["trainer"]["v1"]["trainer_mode"]}

    reference = training(commands["plugin"][1])
    for mode, (_, config) in commands.items():
        assert training(config) == reference, mode
    assert reference["sampler"]["name"] == "TimedReplayBuffer" and reference["mode"] == "sync"
    served = commands["verl_served"][1].reward
    assert served.reward_model.enable is True and served.reward_model.enable_resource_pool is True
    assert served.custom_reward_function.path.endswith("served_reward.py")
    assert commands["no_rm"][1].reward.custom_reward_function.path.endswith("rule.py")
    assert commands["no_rm"][1].reward.reward_model.enable is False
    # logical GPUs: the policy's, plus one for an RM pool of its own
    gpus = {mode: config.ray_kwargs.ray_init.num_gpus for mode, (_, config) in commands.items()}
    assert gpus == {"plugin": 2, "verl_served": 2, "plugin_colocated": 1, "no_rm": 1}


def test_the_default_run_is_the_plugin_against_no_rm_and_all_runs_every_mode():
    assert DemoConfig().mode_list() == DEFAULT_MODES == ("plugin", "no_rm")
    assert DemoConfig(modes="all").mode_list() == ALL_MODES
    assert DemoConfig(modes="no_rm, verl_served").mode_list() == ("verl_served", "no_rm")  # always in ALL_MODES order


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"modes": "plugin,sync"}, r"demo modes='plugin,sync': unknown \['sync'\]; pick from plugin, verl_served"),
    ({"modes": ""}, r"unknown empty"),
    ({"steps": 0}, r"demo steps=0: must be an integer >= 1, e.g. --steps 2"),
    ({"rollout_n": 1}, r"GRPO needs at least 2 responses per prompt"),
    ({"rm_hidden_size": 100}, r"multiple of 64"),
    ({"lr": 0.0}, r"demo lr=0.0: must be a finite number > 0"),
])
def test_a_bad_setting_names_the_key_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kwargs)


def test_the_demo_agent_loop_draws_a_heavy_tail_fixed_by_seed_and_prompt():
    from verl_async_rm.demo.agent_loop import response_tokens

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(400)]
    lengths = [response_tokens(p, median_tokens=40, sigma=1.0, seed=0, budget=256) for p in prompts]
    assert lengths == [response_tokens(p, median_tokens=40, sigma=1.0, seed=0, budget=256) for p in prompts]
    assert 30 <= sorted(lengths)[200] <= 52  # the median
    assert max(lengths) >= 5 * 40 and min(lengths) >= 1 and max(lengths) <= 256  # the tail, clipped to the budget
    assert lengths != [response_tokens(p, median_tokens=40, sigma=1.0, seed=1, budget=256) for p in prompts]


def test_the_agent_loop_yaml_names_the_loop_and_its_settings(tmp_path):
    import yaml

    from verl_async_rm.demo.agent_loop import AGENT_NAME, write_agent_loop_config

    entries = yaml.safe_load(write_agent_loop_config(tmp_path / "a.yaml", median_tokens=12, sigma=0.5, seed=7,
                                                     greedy=False, extra={"other": "pkg.Loop"}).read_text())
    assert entries == [
        {"name": AGENT_NAME, "_target_": "verl_async_rm.demo.agent_loop.LogNormalLengthAgentLoop",
         "median_tokens": 12.0, "sigma": 0.5, "seed": 7, "greedy": False},
        {"name": "other", "_target_": "pkg.Loop", "median_tokens": 12.0, "sigma": 0.5, "seed": 7, "greedy": False},
    ]
    greedy = yaml.safe_load(write_agent_loop_config(tmp_path / "b.yaml", median_tokens=12, sigma=0.5, seed=7)
                            .read_text())
    assert "greedy" not in greedy[0]  # greedy is the loop's default


def test_the_served_mode_sends_what_verls_compute_score_disrm_sends(tiny_models):
    """The verl_served mode's reward function: the conversation rendered with the RM's chat template, BOS stripped,
    raw scores (``use_activation=False``), as ``RewardLoopWorker.compute_score_disrm`` builds its request."""
    from transformers import AutoTokenizer

    from verl_async_rm.demo.served_reward import rm_request

    tok = AutoTokenizer.from_pretrained(tiny_models.rm_alt)  # a template that starts with BOS
    payload = rm_request("how many?", "seven", "/models/rm", tok)
    assert payload["model"] == "/models/rm" and payload["use_activation"] is False
    rendered = tok.apply_chat_template([{"role": "user", "content": "how many?"},
                                        {"role": "assistant", "content": "seven"}], tokenize=False)
    assert rendered.startswith(tok.bos_token) and payload["input"] == rendered[len(tok.bos_token):]


def test_the_demo_folder_is_absolute_wherever_it_is_named(tmp_path, monkeypatch):
    """Each mode's main_ppo runs in its own folder and verl's workers resolve the paths the demo passes from theirs,
    so a relative folder (the default ./async_rm_demo/<time>, or --out rel) must become absolute first."""
    from verl_async_rm.demo.options import DemoConfig
    from verl_async_rm.demo.run import out_dir_of

    monkeypatch.chdir(tmp_path)
    default = out_dir_of(DemoConfig())
    assert default.is_absolute() and default.parent == tmp_path / "async_rm_demo"
    assert out_dir_of(DemoConfig(out_dir="rel/out")) == tmp_path / "rel" / "out"


def test_on_the_v0_trainer_the_manager_times_the_batches_and_the_plugin_modes_opt_in(tmp_path):
    """``--trainer v0``: no replay buffer of the demo's (verl's v0 trainer has none); the modes name the demo's timed
    managers (the plugin's v0 manager, or verl's own), and the plugin modes pass the plugin's checks."""
    from types import SimpleNamespace

    from test_recipes import compose

    from verl_async_rm.integration.checks import check_verl_config

    assets = SimpleNamespace(policy=tmp_path / "policy", rm=tmp_path / "rm", train_file=tmp_path / "train.parquet",
                             val_file=tmp_path / "val.parquet")
    config = DemoConfig(modes="all", trainer="v0")
    for mode in config.mode_list():
        overrides = mode_overrides(mode, config, assets, agent_loops=tmp_path / "loops.yaml",
                                   record_path=tmp_path / mode / "t.jsonl", ray_temp_dir="/tmp/vardX")
        composed = compose(overrides)
        manager = composed.actor_rollout_ref.rollout.agent.agent_loop_manager_class
        assert composed.trainer.use_v1 is False and "custom_sampler" not in str(overrides)
        if mode.startswith("plugin"):
            assert manager == "verl_async_rm.demo.v0_timing.TimedAsyncRMAgentLoopManager"
            assert check_verl_config(composed).rm.placement == (
                "policy_pool" if mode == "plugin_colocated" else "own_pool")
        else:
            assert manager == "verl_async_rm.demo.v0_timing.TimedAgentLoopManager"
    with pytest.raises(ValueError, match="trainer='v2': use v1 or v0"):
        DemoConfig(trainer="v2")


def test_a_sigterm_to_the_demo_unwinds_it_so_its_run_is_stopped(tmp_path):
    """``kill <demo>`` (or a CI timeout) must not leave the mode's ``main_ppo`` run behind: it runs in a session of
    its own, which a signal to the demo does not reach, and the mode's clean-up (a ``finally``) stops it. Here the
    demo's entry point (``verl-async-rm demo``, its signal handling) runs for real; its run is a stand-in that starts a
    child in a session of its own and stops it in a ``finally``, as a mode's run does."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    import psutil

    script = tmp_path / "demo_stand_in.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        import verl_async_rm.demo
        from verl_async_rm.cli import main

        def run_demo(config):
            child = subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL)
            try:
                print(child.pid, flush=True)
                time.sleep(600)
            finally:
                os.killpg(child.pid, 15)
                child.wait(timeout=30)
                print("stopped", flush=True)

        verl_async_rm.demo.run_demo = run_demo
        sys.exit(main(["demo", "--no-progress"]))
    """))
    demo = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(demo.stdout.readline())
    demo.send_signal(signal.SIGTERM)
    out, _ = demo.communicate(timeout=60)
    assert demo.returncode == 128 + signal.SIGTERM and "stopped" in out
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the run's process {child} outlived the demo"
        time.sleep(0.1)
    assert os.getpgid(os.getpid()) != child  # the child was in a session of its own, not the test's
