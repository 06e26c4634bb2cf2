"""Every recipe in ``recipes/`` composes against the installed verl's config and passes verl's and the plugin's checks.

No GPU, no Ray. Each recipe is run with ``VERL_ASYNC_RM_RECIPE_DRY_RUN=1``: bash expands it as it would for a real
launch and prints the exact command (NUL-separated) instead of running it. The test then composes exactly those
overrides with Hydra against verl's own ``ppo_trainer`` config (the config ``verl.trainer.main_ppo`` and
``verl_async_rm.main_ppo`` load), migrates legacy keys as ``verl_async_rm.main_ppo`` does when the recipe launches
through it, and validates:

- verl's own ``validate_config`` (batch sizes against the policy GPUs, micro batches, ...), as verl's ``main`` runs it;
- the plugin's ``check_verl_config``, ``AsyncRMConfig.from_verl`` and the RM pool it would reserve (the real pool
  sizes, e.g. 6 + 2 GPUs on one node, 2 x (6 + 2) on two nodes; none for an RM served at an endpoint), and the
  manager class verl would load.

A recipe whose RM is served elsewhere (``async_rm.endpoint``) is checked the same way without contacting its server:
``check_verl_config`` reads the config only; ``probe_endpoints``, which verl's ``validate_config`` runs through the
plugin's hook before Ray starts, is recorded here instead of run (the recipes' servers do not exist here).

A misspelt key cannot pass: Hydra refuses to override a key verl does not declare, ``+`` (add a key) is allowed only
for the plugin's own keys, whose names the plugin checks, and the mutation tests below prove each path fails.
The default model and data paths do not exist here, which the checks allow (the RM replicas check their paths when
they load, on the cluster); one test also points the recipes at tiny local checkpoints instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from verl_async_rm.config import AsyncRMConfig
from verl_async_rm.integration import checks
from verl_async_rm.integration.checks import ENTRY_MODULE, check_verl_config, legacy_keys_set
from verl_async_rm.main_ppo import migrate_legacy_keys
from verl_async_rm.testing.trainer_config import verl_config_dir

pytestmark = [
    pytest.mark.unit,
    # verl's validate_config warns that GRPO needs no critic
    pytest.mark.filterwarnings("ignore:Disabled critic as algorithm.adv_estimator:UserWarning"),
]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DRY_RUN_ENV = "VERL_ASYNC_RM_RECIPE_DRY_RUN"
VERL_ENTRY = "verl.trainer.main_ppo"
MANAGER_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
GPUS_PER_NODE = 8
#: Stands in for $HOME in the dry runs, so the default paths are known.
HOME = "/home/recipe-user"
POLICY_HUB_ID = "Qwen/Qwen2.5-3B-Instruct"
RM_HUB_ID = "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2"
DEFAULT_DATA = f"{HOME}/data/gsm8k"


@dataclass(frozen=True)
class Layout:
    """What a recipe promises in its header: entry module, pools, reward weights."""

    entry: str
    nnodes: int
    policy_gpus_per_node: int
    rm_gpus_per_node: int
    rm_nnodes: int
    rm_weight: float
    rule_weight: float
    #: async_rm.models.<name>: (n_gpus_per_node, nnodes, weight)
    extra_rms: dict = field(default_factory=dict)
    #: RMs whose replicas take more than one GPU: name -> gpus_per_replica
    sharded_rms: dict = field(default_factory=dict)
    #: the policy's and the pool RM's Hub ids and default directories, and the variable that moves the RM
    policy_hub: str = POLICY_HUB_ID
    rm_hub: str = RM_HUB_ID
    rm_env: str = "RM_PATH"
    #: the RM on the policy's GPUs (enable_resource_pool=False): one replica per GPU of the trainer
    policy_pool: bool = False
    #: the rollout's tensor_model_parallel_size
    rollout_tp: int = 1
    #: algorithm.adv_estimator
    adv_estimator: str = "grpo"
    #: An RM served elsewhere (async_rm.endpoint): its default base URL (rm_env moves it) and model; no replica and no
    #: pool, so the policy has every GPU
    endpoint: str | None = None
    endpoint_model: str | None = None
    #: the variable that holds its API key (async_rm.api_key_env), None when it takes none
    api_key_env: str | None = None
    #: what the header shows of the command that starts its server (none for a hosted API)
    server: tuple[str, ...] = ()

    @property
    def remote(self) -> bool:
        return self.endpoint is not None


RECIPES: dict[str, Layout] = {
    # the recommended layout on one node: the RM on the policy's 8 GPUs, one replica beside the actor on each
    "grpo_gsm8k_1node.sh": Layout(VERL_ENTRY, 1, 8, 8, 1, rm_weight=1.0, rule_weight=0.0, policy_pool=True),
    # the same job with the RM on a pool of its own: 6 + 2, batch sizes that split over 6
    "grpo_gsm8k_1node_own_pool.sh": Layout(VERL_ENTRY, 1, 6, 2, 1, rm_weight=1.0, rule_weight=0.0),
    # two nodes, the RM on the policy's 8 + 8 GPUs
    "grpo_gsm8k_2nodes.sh": Layout(VERL_ENTRY, 2, 8, 8, 2, rm_weight=1.0, rule_weight=0.0, policy_pool=True),
    # a 7B policy with its rollout tensor parallel over 2 of its 6 GPUs, batch sizes that split over 6
    "grpo_gsm8k_7b_tp2.sh": Layout(VERL_ENTRY, 1, 6, 2, 1, rm_weight=1.0, rule_weight=0.0,
                                   policy_hub="Qwen/Qwen2.5-7B-Instruct", rollout_tp=2),
    "grpo_gsm8k_legacy_keys.sh": Layout(ENTRY_MODULE, 1, 6, 2, 1, rm_weight=1.0, rule_weight=0.0),
    "grpo_gsm8k_rm_plus_rule.sh": Layout(VERL_ENTRY, 1, 8, 8, 1, rm_weight=0.1, rule_weight=1.0, policy_pool=True),
    # two RMs, 1 GPU each (the second's pool is async_rm.models.second.*), verl's naive manager (rule_weight 1.0)
    "grpo_gsm8k_two_rms.sh": Layout(VERL_ENTRY, 1, 6, 1, 1, rm_weight=0.1, rule_weight=1.0,
                                    extra_rms={"second": (1, 1, 0.05)}),
    # an outcome RM and a process RM with token-level step rewards (async_rm.models.prm.*), verl's naive manager, and
    # an estimator that reads each token's reward (GRPO would see only their sum)
    "reinforce_plus_plus_gsm8k_prm_steps.sh": Layout(VERL_ENTRY, 1, 6, 1, 1, rm_weight=0.1, rule_weight=1.0,
                                                     extra_rms={"prm": (1, 1, 0.1)},
                                                     adv_estimator="reinforce_plus_plus"),
    # an RM and an instruct model as a yes/no judge (async_rm.models.judge.*, logits readout), verl's naive manager
    "grpo_gsm8k_judge.sh": Layout(VERL_ENTRY, 1, 6, 1, 1, rm_weight=0.1, rule_weight=1.0,
                                  extra_rms={"judge": (1, 1, 0.5)}),
    # the same with a 72B process RM: one replica of 4 GPUs (gpus_per_replica=4), the policy on 3
    "grpo_gsm8k_prm72b_sharded.sh": Layout(VERL_ENTRY, 1, 3, 1, 1, rm_weight=0.1, rule_weight=1.0,
                                           extra_rms={"prm": (4, 1, 0.5)}, sharded_rms={"prm": 4}),
    # a 72B judge writing a 0-10 verdict as the pool's RM, one 4-GPU tensor-parallel vLLM replica per node, a 32B
    # policy on 4+4 GPUs, verl's naive manager's rule
    "grpo_gsm8k_judge70b_2nodes.sh": Layout(VERL_ENTRY, 2, 4, 4, 2, rm_weight=0.05, rule_weight=1.0,
                                            sharded_rms={"main": 4}, policy_hub="Qwen/Qwen2.5-32B-Instruct",
                                            rm_hub="Qwen/Qwen2.5-72B-Instruct", rm_env="JUDGE_PATH", rollout_tp=4),
    # a 72B yes/no judge served by vLLM on another node (async_rm.endpoint, logits readout): no RM pool, the policy on
    # all 8 GPUs, verl's naive manager's rule
    "grpo_gsm8k_judge70b_remote.sh": Layout(
        VERL_ENTRY, 1, 8, 0, 0, rm_weight=0.5, rule_weight=1.0, rm_hub="Qwen/Qwen2.5-72B-Instruct", rm_env="JUDGE_URL",
        endpoint="http://judge-node:8000/v1", endpoint_model="judge",
        server=("vllm serve $HOME/models/Qwen2.5-72B-Instruct --tensor-parallel-size 8",
                "--served-model-name judge --port 8000")),
    # a hosted OpenAI-compatible API as a judge writing a 0-10 verdict, within a provider tier's limits, its key in an
    # environment variable: no RM pool, the policy on all 8 GPUs
    "grpo_gsm8k_judge_hosted_api.sh": Layout(
        VERL_ENTRY, 1, 8, 0, 0, rm_weight=0.05, rule_weight=1.0, rm_hub="gpt-4o-mini", rm_env="JUDGE_URL",
        endpoint="https://api.openai.com/v1", endpoint_model="gpt-4o-mini", api_key_env="JUDGE_API_KEY"),
    # a group judge (one call per GRPO group) as the pool's RM, two 1-GPU vLLM replicas, verl's naive manager's rule
    "grpo_gsm8k_group_judge_local.sh": Layout(VERL_ENTRY, 1, 6, 2, 1, rm_weight=0.5, rule_weight=1.0,
                                              rm_hub="Qwen/Qwen2.5-7B-Instruct", rm_env="JUDGE_PATH"),
    # the same judge kind served by vLLM on another node (a 72B model, tensor parallel 8): no pool, the policy on 8
    "grpo_gsm8k_group_judge_remote.sh": Layout(
        VERL_ENTRY, 1, 8, 0, 0, rm_weight=0.5, rule_weight=1.0, rm_hub="Qwen/Qwen2.5-72B-Instruct", rm_env="JUDGE_URL",
        endpoint="http://judge-node:8000/v1", endpoint_model="judge",
        server=("vllm serve $HOME/models/Qwen2.5-72B-Instruct --tensor-parallel-size 8", "--served-model-name judge",
                """--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'""")),
    # a pairwise judge (each pair of a group in both orders) on the policy's 8 GPUs, logits on transformers
    "grpo_gsm8k_pairwise_judge.sh": Layout(VERL_ENTRY, 1, 8, 8, 1, rm_weight=0.5, rule_weight=1.0,
                                           rm_hub="Qwen/Qwen2.5-7B-Instruct", rm_env="JUDGE_PATH", policy_pool=True),
    # the same kind served by vLLM on another node, writing {"winner": ...}: no pool, the policy on 8
    "grpo_gsm8k_pairwise_judge_remote.sh": Layout(
        VERL_ENTRY, 1, 8, 0, 0, rm_weight=0.5, rule_weight=1.0, rm_hub="Qwen/Qwen2.5-72B-Instruct", rm_env="JUDGE_URL",
        endpoint="http://judge-node:8000/v1", endpoint_model="judge",
        server=("vllm serve $HOME/models/Qwen2.5-72B-Instruct --tensor-parallel-size 8", "--served-model-name judge",
                """--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'""")),
}


def default_path(hub_id: str) -> str:
    """Where a recipe's header downloads ``hub_id`` to (``$HOME/models/<name>``)."""
    return f"{HOME}/models/{hub_id.split('/')[-1]}"


def dry_run(recipe: str, *args: str, **env: str) -> list[str]:
    """The command the recipe would exec, as bash expands it (argv list)."""
    bash = shutil.which("bash")
    assert bash is not None, "bash is needed to expand the recipes"
    base = {k: v for k, v in os.environ.items()
            if k not in ("POLICY_PATH", "RM_PATH", "RM2_PATH", "PRM_PATH", "JUDGE_PATH", "DATA_DIR", "JUDGE_URL",
                         "JUDGE_MODEL", "JUDGE_API_KEY")}
    proc = subprocess.run(
        [bash, str(RECIPES_DIR / recipe), *args],
        check=False,
        env={**base, "HOME": HOME, DRY_RUN_ENV: "1", **env},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert out.endswith("\0"), f"{recipe}: the dry run must print the command NUL-separated, got {out[-200:]!r}"
    return out[:-1].split("\0")


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """``python3 -m <module> <overrides...>`` -> (module, overrides)."""
    assert argv[:2] == ["python3", "-m"], f"a recipe launches `python3 -m <module> ...`, got {argv[:3]}"
    return argv[2], argv[3:]


def compose(overrides: list[str]):
    """verl's ``ppo_trainer`` config with ``overrides`` applied, as ``@hydra.main`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return hydra_compose(config_name="ppo_trainer", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def override_key(override: str) -> str:
    return override.split("=", 1)[0]


def check_added_keys(overrides: list[str]) -> None:
    """``+key=value`` adds a key Hydra cannot check, so it is allowed only for the plugin's keys, checked by name
    (the manager class by loading it, ``async_rm.*`` by ``AsyncRMConfig.from_verl``)."""
    for override in overrides:
        key = override_key(override)
        if key.startswith("+"):
            name = key.lstrip("+")
            if name != MANAGER_KEY and not name.startswith("async_rm."):
                raise ValueError(f"{override}: '+' adds a key verl does not declare; only {MANAGER_KEY} and async_rm.*")


def validate(argv: list[str]):
    """Everything a launch of ``argv`` would check before touching a GPU. Returns (config, AsyncRMConfig)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.import_utils import load_class_from_fqn

    import verl_async_rm

    entry, overrides = split_command(argv)
    check_added_keys(overrides)
    config = compose(overrides)  # raises on a key verl does not declare
    if legacy_keys_set(config) and entry != ENTRY_MODULE:
        # verl's main_ppo would ignore them: only the package's entry module migrates them
        raise ValueError(f"legacy keys {legacy_keys_set(config)} need `python3 -m {ENTRY_MODULE}`, not {entry}")
    if entry == ENTRY_MODULE:
        config = migrate_legacy_keys(config)  # what verl_async_rm.main_ppo.main does first
    elif entry != VERL_ENTRY:
        raise ValueError(f"unknown entry module {entry}")
    check_verl_config(config)
    settings = AsyncRMConfig.from_verl(config)
    # what verl's main runs (verl/trainer/main_ppo.py main) before it starts Ray
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    # what verl's task runner does with the manager key (trainer/main_ppo.py, ray_trainer.py)
    fqn = OmegaConf.select(config, MANAGER_KEY, default=None)
    if not fqn:
        raise ValueError(f"no agent-loop manager: set +{MANAGER_KEY}=verl_async_rm.AsyncRMAgentLoopManager")
    manager = load_class_from_fqn(fqn, "AgentLoopManager")
    if manager is not verl_async_rm.AsyncRMAgentLoopManager:
        raise ValueError(f"{MANAGER_KEY} loads {manager}, not verl_async_rm.AsyncRMAgentLoopManager")
    return config, settings


#: Recipes for machines without GPUs, checked by their own test module (test_cpu_recipe_command.py).
CPU_RECIPES = ("grpo_cpu_tiny.sh",)


@pytest.fixture(autouse=True)
def probed(monkeypatch) -> list[str]:
    """The endpoints a launch would probe before Ray starts (``probe_endpoints``, run by verl's ``validate_config``
    through the plugin's hook), as ``<rm name>:<url>``: recorded, never contacted."""
    seen: list[str] = []

    def record(settings: AsyncRMConfig) -> None:
        seen.extend(f"{e.name}:{url}" for e in settings.models if e.rm.remote for url in e.rm.endpoint)

    monkeypatch.setattr(checks, "probe_endpoints", record)
    return seen


def test_the_table_lists_every_recipe():
    """A new recipe must declare its layout here (or be a CPU recipe with its own tests), so it cannot go
    unchecked."""
    assert sorted(p.name for p in RECIPES_DIR.glob("*.sh")) == sorted([*RECIPES, *CPU_RECIPES])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_header_names_prerequisites_models_and_the_launch_command(recipe):
    text = (RECIPES_DIR / recipe).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    header = text.split("\nset -euo pipefail", 1)[0]
    for section in ("Prerequisites", "GPUs", "Install", "Models", "Data", "Launch"):
        assert re.search(rf"^#\s+{section}\b", header, re.MULTILINE), f"{recipe}: header has no {section!r} entry"
    assert f"bash recipes/{recipe}" in header
    assert RECIPES[recipe].policy_hub in header and RECIPES[recipe].rm_hub in header
    if RECIPES[recipe].server:  # an RM served elsewhere: the command that starts its server, not a checkpoint's class
        assert all(part in header for part in RECIPES[recipe].server), f"{recipe}: the header lacks its server command"
    elif RECIPES[recipe].remote:  # a hosted API: the variable its key is exported as
        assert f"export {RECIPES[recipe].api_key_env}=" in header
    else:  # the checkpoint's class: a sequence classifier, or a causal LM for a judge
        assert "ForSequenceClassification" in header or "ForCausalLM" in header
    assert "examples/data_preprocess/gsm8k.py" in header
    assert f"{RECIPES[recipe].nnodes} node{'s' if RECIPES[recipe].nnodes > 1 else ''} x {GPUS_PER_NODE} GPUs" in header


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_is_valid_bash_and_launches_its_entry_module(recipe):
    subprocess.run(["bash", "-n", str(RECIPES_DIR / recipe)], check=True, timeout=30)
    entry, overrides = split_command(dry_run(recipe))
    assert entry == RECIPES[recipe].entry
    assert len(overrides) == len(set(map(override_key, overrides))), "a key is set twice"


@pytest.mark.parametrize("trainer", ["v1", "v0"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_composes_and_passes_verl_and_plugin_checks(recipe, trainer, probed):
    layout = RECIPES[recipe]
    extra = [] if trainer == "v1" else ["trainer.use_v1=False"]  # extra arguments go through "$@", last
    argv = dry_run(recipe, *extra)
    assert argv[len(argv) - len(extra) :] == extra
    config, settings = validate(argv)

    assert config.trainer.use_v1 is (trainer == "v1")
    assert config.algorithm.adv_estimator == layout.adv_estimator
    assert config.actor_rollout_ref.rollout.n > 1  # GRPO needs a group per prompt (the others are given one too)
    # token-level step rewards only with an estimator that reads each token's reward (a sum-only one pays for steps)
    token_level = [e.name for e in settings.models if (e.rm.reward_kind, e.rm.process_reduction) == ("process", "none")]
    assert not token_level or layout.adv_estimator in ("reinforce_plus_plus", "gae")
    assert config.data.train_files == f"{DEFAULT_DATA}/train.parquet"
    assert config.data.val_files == f"{DEFAULT_DATA}/test.parquet"
    assert config.data.return_raw_chat is True  # the RM re-renders raw_prompt + response with its own template
    assert config.actor_rollout_ref.model.path == default_path(layout.policy_hub)
    # the pools: the policy's and the RM's GPUs fill each 8-GPU node exactly
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (layout.nnodes, layout.policy_gpus_per_node)
    rm = settings.rm
    if layout.remote:  # served elsewhere: nothing placed, and the launch asks the server before Ray starts
        assert rm.remote and (rm.endpoint, rm.endpoint_model) == ((layout.endpoint,), layout.endpoint_model)
        assert rm.api_key_env == layout.api_key_env
        assert [e.name for e in settings.models if not e.rm.remote] == []
        assert probed == [f"main:{layout.endpoint}"]
    else:
        assert (rm.nnodes, rm.n_gpus_per_node) == (layout.rm_nnodes, layout.rm_gpus_per_node)
        assert rm.num_replicas == layout.rm_nnodes * layout.rm_gpus_per_node // rm.gpus_per_replica
        assert probed == []
    assert rm.nnodes <= config.trainer.nnodes
    extras = {e.name: (e.rm.n_gpus_per_node, e.rm.nnodes, e.weight) for e in settings.models[1:]}
    assert extras == layout.extra_rms
    assert {e.name: e.rm.gpus_per_replica for e in settings.models if e.rm.gpus_per_replica > 1} == layout.sharded_rms
    own_pools = [e.rm for e in settings.models if e.rm.placement != "policy_pool" and not e.rm.remote]
    assert config.trainer.n_gpus_per_node + sum(rm.n_gpus_per_node for rm in own_pools) == GPUS_PER_NODE
    assert all(e.rm.use_gpu and (e.rm.remote or os.path.isabs(e.rm.model_path)) for e in settings.models)
    assert config.reward.reward_model.enable is False
    # an RM served elsewhere needs no reward pool: verl's resource check then counts the policy's GPUs only
    assert config.reward.reward_model.enable_resource_pool is not (layout.policy_pool or layout.remote)
    if not layout.remote:
        assert (rm.placement == "policy_pool") is layout.policy_pool
    rollout = config.actor_rollout_ref.rollout
    assert rollout.tensor_model_parallel_size == layout.rollout_tp
    assert layout.policy_gpus_per_node % layout.rollout_tp == 0  # the rollout's TP divides the policy's GPUs
    assert rm.use_gpu is True
    # the RM replicas load both from local directories on the cluster (not Hub ids); a served RM needs no checkpoint
    # here, the policy's tokenizer still (it decodes the responses the RM reads)
    assert rm.model_path == (None if layout.remote else default_path(layout.rm_hub))
    assert rm.policy_tokenizer_path == default_path(layout.policy_hub)
    assert (layout.remote or os.path.isabs(rm.model_path)) and os.path.isabs(rm.policy_tokenizer_path)
    assert rm.retemplate == "auto"  # Llama-3 RM, Qwen policy: re-rendered
    assert (settings.mix.rm_weight, settings.mix.rule_weight) == (layout.rm_weight, layout.rule_weight)
    assert settings.mix.combine_fn is None


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_paths_come_from_the_environment(recipe, tiny_models, tiny_judges, tmp_path):
    """POLICY_PATH / RM_PATH / DATA_DIR replace the defaults. They point at real local checkpoints here (the tiny
    Qwen2 policy and the tiny Llama sequence-classification RM with its own chat template, like the recipes' pair), so
    any check that reads a checkpoint found on this machine runs on a real one."""
    policy, rm = str(tiny_models.policy), str(tiny_models.rm_alt)
    if RECIPES[recipe].rm_env == "JUDGE_PATH":  # the pool's RM is a judge: a causal LM
        rm = str(tiny_judges.lm)
    if RECIPES[recipe].remote:  # served elsewhere: moved by its base URL
        rm = "http://10.0.0.5:8000/v1"
    argv = dry_run(recipe, POLICY_PATH=policy, **{RECIPES[recipe].rm_env: rm}, DATA_DIR=str(tmp_path))
    config, settings = validate(argv)
    assert config.actor_rollout_ref.model.path == policy
    where = settings.rm.endpoint[0] if RECIPES[recipe].remote else settings.rm.model_path
    assert (where, settings.rm.policy_tokenizer_path) == (rm, policy)
    assert config.data.train_files == f"{tmp_path}/train.parquet"


def test_the_legacy_recipe_needs_the_entry_module():
    """Launched with verl's own main_ppo, the same overrides would run without the reward pool: refused."""
    entry, overrides = split_command(dry_run("grpo_gsm8k_legacy_keys.sh"))
    assert entry == ENTRY_MODULE
    raw = compose(overrides)
    assert set(legacy_keys_set(raw)) >= {
        "reward_model.enable_resource_pool",
        "reward_model.n_gpus_per_node",
        "reward_model.nnodes",
        "reward_model.model.path",
        "reward_model.reward_manager",
    }
    assert raw.reward.reward_model.enable_resource_pool is False  # verl's default: nothing moved yet
    with pytest.raises(ValueError, match="legacy keys"):
        check_verl_config(raw)
    with pytest.raises(ValueError, match="need `python3 -m verl_async_rm.main_ppo`"):
        validate(["python3", "-m", VERL_ENTRY, *overrides])
    # migrated, it is the same run as the recipe written with reward.* keys
    legacy_config, _ = validate(["python3", "-m", entry, *overrides])
    new_config, _ = validate(dry_run("grpo_gsm8k_1node_own_pool.sh"))
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(legacy_config.reward) == OmegaConf.to_container(new_config.reward)


def test_the_judge_recipe_reads_yes_against_no_at_the_judges_next_token():
    _, settings = validate(dry_run("grpo_gsm8k_judge.sh"))
    judge = {e.name: e.rm for e in settings.models}["judge"]
    assert (judge.reward_kind, judge.judge_readout, judge.judge_tokens) == ("judge", "logits", ("Yes", "No"))
    assert judge.model_path == f"{HOME}/models/Qwen2.5-7B-Instruct" and "{{ ground_truth }}" in judge.judge_prompt


def test_the_72b_judge_recipe_runs_one_4_gpu_tensor_parallel_replica_per_node():
    """Two replicas of 4 GPUs, a judge writing a 0-10 verdict weighted so that a perfect grade is half a correct
    answer (the header's sizing note), the rule from verl's naive manager."""
    _, settings = validate(dry_run("grpo_gsm8k_judge70b_2nodes.sh"))
    [judge] = [e.rm for e in settings.models]
    assert (judge.reward_kind, judge.judge_readout, judge.on_vllm) == ("judge", "generate", True)
    assert (judge.gpus_per_replica, judge.replicas_per_node, judge.num_replicas) == (4, 1, 2)
    assert "0 (wrong) to 10 (correct)" in judge.judge_prompt and "{{ ground_truth }}" in judge.judge_prompt
    assert settings.mix.combine(rm_score=10.0, rule_score=1.0) == pytest.approx(0.5 + 1.0)


def test_the_remote_72b_judge_recipe_reads_yes_against_no_at_its_first_token():
    """The judge at the other node's vLLM server: P(Yes) among Yes/No at the first token, at most 128 requests in flight
    from the whole job, no provider limits and no key, no copy of the judge on the training node."""
    config, settings = validate(dry_run("grpo_gsm8k_judge70b_remote.sh"))
    [judge] = [e.rm for e in settings.models]
    assert (judge.reward_kind, judge.judge_readout, judge.judge_tokens) == ("judge", "logits", ("Yes", "No"))
    assert (judge.max_concurrency, judge.max_rpm, judge.max_tpm, judge.api_key_env) == (128, None, None, None)
    assert judge.model_path is None and "{{ ground_truth }}" in judge.judge_prompt
    assert settings.mix.combine(rm_score=1.0, rule_score=1.0) == pytest.approx(0.5 + 1.0)
    assert config.reward.reward_model.enable_resource_pool is False


def test_the_hosted_api_recipe_names_its_key_and_keeps_to_the_providers_limits():
    """The key is read from the variable the recipe names, never put on the command line; the judge writes its
    verdict (chat completions only), re-asked twice when it does not parse, within 500 requests and 200k tokens a
    minute, weighted like the 2-node judge's 0-10 grade."""
    secret = "sk-test-0123456789abcdef"
    argv = dry_run("grpo_gsm8k_judge_hosted_api.sh", JUDGE_API_KEY=secret, JUDGE_MODEL="other-model")
    assert not [arg for arg in argv if secret in arg]
    _, settings = validate(argv)
    [judge] = [e.rm for e in settings.models]
    assert (judge.api_key_env, judge.endpoint_model) == ("JUDGE_API_KEY", "other-model")
    assert re.fullmatch(r"[A-Z][A-Z0-9_]*", judge.api_key_env)  # a variable's name, not a key
    assert (judge.reward_kind, judge.judge_readout, judge.judge_retries) == ("judge", "generate", 2)
    assert (judge.max_rpm, judge.max_tpm, judge.max_concurrency) == (500, 200_000, 32)
    assert settings.mix.combine(rm_score=10.0, rule_score=1.0) == pytest.approx(0.5 + 1.0)
    text = (RECIPES_DIR / "grpo_gsm8k_judge_hosted_api.sh").read_text()
    assert not re.search(r"\bsk-[A-Za-z0-9]{8}|Bearer [A-Za-z0-9]", text), "a key in the script"
@pytest.mark.parametrize("recipe", ["grpo_gsm8k_group_judge_local.sh", "grpo_gsm8k_group_judge_remote.sh"])
def test_the_group_judge_recipes_grade_each_group_in_one_call_within_the_judges_context(recipe):
    """A 0-10 grade per label over judge_scale 10, weighted so that a perfect grade is half a correct answer; re-asks;
    the wait for a short group below the request's; a whole group's input (5 responses at the longest, the prompt and
    the instructions) within max_length less the reply's tokens where the plugin loads the judge."""
    config, settings = validate(dry_run(recipe))
    judge = settings.rm
    assert (judge.reward_kind, judge.judge_scale, judge.writes) == ("group_judge", 10.0, True)
    assert judge.judge_retries >= 1 and judge.group_wait_s < settings.integration.request_timeout_s
    assert settings.mix.combine(rm_score=1.0, rule_score=1.0) == pytest.approx(0.5 + 1.0)
    assert settings.mix.verdict_rms == ("main",)  # the label and the reply in reward_extra_info
    assert settings.mix.group_rms == ("main",)  # told of a trajectory that will never come
    rollout, data = config.actor_rollout_ref.rollout, config.data
    group_tokens = rollout.n * data.max_response_length + data.max_prompt_length + 400  # 400: the instructions
    if judge.remote:
        assert judge.model_path is None and judge.max_concurrency and "{{ responses }}" in judge.judge_prompt
    else:
        assert group_tokens <= judge.max_length - judge.judge_max_tokens and judge.on_vllm


def test_the_rule_of_the_rm_plus_rule_recipe_is_verls_gsm8k_rule():
    """rule_weight > 0 with no custom_reward_function: verl's default_compute_score for the data source that verl's
    GSM8K preprocessing writes ("openai/gsm8k") scores 1.0 for the right number after '####' and 0.0 otherwise."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import default_compute_score

    config, settings = validate(dry_run("grpo_gsm8k_rm_plus_rule.sh"))
    assert settings.mix.rule_weight > 0 and settings.mix.rm_weight > 0
    assert get_custom_reward_fn(config) is None
    assert default_compute_score("openai/gsm8k", "6 * 12 = 72.\n#### 72", "72") == 1.0
    assert default_compute_score("openai/gsm8k", "6 * 12 = 70.\n#### 70", "72") == 0.0
    assert settings.mix.combine(rm_score=2.0, rule_score=1.0) == pytest.approx(0.1 * 2.0 + 1.0)


def _misspell(override: str) -> str:
    key, value = override.split("=", 1)
    return f"{key}x={value}"


def _drop(override: str) -> None:
    return None


UNKNOWN_KEY = "Could not override"
# (recipe, the override to break, how, the error it must raise): every way a mistake could hide is refused
MUTATIONS = [
    ("grpo_gsm8k_1node.sh", "data.train_batch_size=", _misspell, UNKNOWN_KEY),
    ("grpo_gsm8k_1node_own_pool.sh", "reward.reward_model.n_gpus_per_node=", _misspell, UNKNOWN_KEY),
    ("grpo_gsm8k_1node.sh", "reward.reward_model.enable_resource_pool=", _misspell, UNKNOWN_KEY),
    ("grpo_gsm8k_1node_own_pool.sh", "reward.reward_model.enable_resource_pool=", _drop, "enable_resource_pool=False"),
    # a pool's size with the RM on the policy's GPUs: verl would replace it with the trainer's
    ("grpo_gsm8k_1node.sh", "reward.reward_model.enable_resource_pool=",
     lambda o: "reward.reward_model.nnodes=2", "with a reward pool sized"),
    ("grpo_gsm8k_1node.sh", f"+{MANAGER_KEY}=", _misspell, "adds a key verl does not declare"),
    ("grpo_gsm8k_1node.sh", f"+{MANAGER_KEY}=", _drop, "no agent-loop manager"),
    ("grpo_gsm8k_1node.sh", f"+{MANAGER_KEY}=", lambda o: o + "X", "AsyncRMAgentLoopManagerX"),
    ("grpo_gsm8k_1node.sh", "+async_rm.max_wait_ms=", _misspell, "unknown key async_rm.max_wait_msx"),
    ("grpo_gsm8k_1node.sh", "+async_rm.max_wait_ms=", lambda o: "+async_rm.max_wait_ms=-1", "max_wait_ms"),
    ("grpo_gsm8k_1node.sh", "reward.reward_manager.name=", lambda o: o + "x", "reward.reward_manager.name='async_rmx'"),
    # 241 prompts x 5 samples do not split over 6 policy GPUs: verl's own validate_config refuses it
    ("grpo_gsm8k_1node_own_pool.sh", "data.train_batch_size=", lambda o: "data.train_batch_size=241", "divisible"),
    # verl's usual 1024 prompts x 5 do not split over 6 either (an AssertionError, not the plugin's ValueError)
    ("grpo_gsm8k_1node_own_pool.sh", "data.train_batch_size=", lambda o: "data.train_batch_size=1024", "(5120)"),
    ("grpo_gsm8k_2nodes.sh", "trainer.nnodes=", _misspell, UNKNOWN_KEY),
    ("grpo_gsm8k_legacy_keys.sh", "reward_model.n_gpus_per_node=", _misspell, UNKNOWN_KEY),
    ("grpo_gsm8k_legacy_keys.sh", "reward_model.model.path=", _misspell, UNKNOWN_KEY),
    ("grpo_gsm8k_rm_plus_rule.sh", "+async_rm.rule_weight=", _misspell, "unknown key async_rm.rule_weightx"),
    ("grpo_gsm8k_two_rms.sh", "+async_rm.models.second.weight=", _misspell,
     "unknown key async_rm.models.second.weightx"),
    ("grpo_gsm8k_two_rms.sh", "+async_rm.models.second.model_path=", _drop, "each extra RM needs its path"),
    ("grpo_gsm8k_two_rms.sh", "reward.reward_manager.name=", lambda o: o + "x", "name='naivex' (source='register')"),
    ("grpo_gsm8k_judge70b_remote.sh", "+async_rm.endpoint=", _misspell, "unknown key async_rm.endpointx"),
    ("grpo_gsm8k_judge70b_remote.sh", "+async_rm.endpoint=", _drop, "the plugin needs a reward model"),
    ("grpo_gsm8k_judge70b_remote.sh", "+async_rm.endpoint=", lambda o: "+async_rm.endpoint=judge-node:8000/v1",
     "needs a scheme"),
    # a setting of a replica the plugin loads (the 2-node recipe's 4-GPU judge) means nothing for a served RM
    ("grpo_gsm8k_judge70b_remote.sh", "+async_rm.max_concurrency=", lambda o: "+async_rm.gpus_per_replica=4",
     "only means something for an RM the plugin loads"),
    ("grpo_gsm8k_judge_hosted_api.sh", "+async_rm.api_key_env=", _misspell, "unknown key async_rm.api_key_envx"),
    # a minute's tokens must hold one request: its prompt and judge_max_tokens=256
    ("grpo_gsm8k_judge_hosted_api.sh", "+async_rm.max_tpm=", lambda o: "+async_rm.max_tpm=200", "max_tpm"),
    ("grpo_gsm8k_judge_hosted_api.sh", "+async_rm.judge_retries=", lambda o: "+async_rm.judge_retries=-1",
     "judge_retries"),
]


@pytest.mark.parametrize(
    ("recipe", "prefix", "mutate", "error"),
    MUTATIONS,
    ids=[f"{r[:-3]}:{p.strip('+=')}:{e[:24]}" for r, p, _, e in MUTATIONS],
)
def test_a_broken_override_is_refused(recipe, prefix, mutate, error):
    from hydra.errors import HydraException

    argv = dry_run(recipe)
    hits = [i for i, arg in enumerate(argv) if arg.startswith(prefix)]
    assert len(hits) == 1, f"{recipe} has no single {prefix!r} override"
    broken = mutate(argv[hits[0]])
    argv[hits[0] : hits[0] + 1] = [] if broken is None else [broken]
    with pytest.raises((HydraException, ValueError, AssertionError, AttributeError), match=re.escape(error)):
        validate(argv)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_key_without_plus_is_declared_by_verl(recipe):
    """Hydra refuses unknown keys without '+': shown directly for every key a recipe sets (no compose needed)."""
    from omegaconf import DictConfig, OmegaConf

    defaults = compose([])

    def declared(key: str) -> bool:  # by the parent's keys: a mandatory '???' value has no value to select
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(defaults, parent, default=None) if parent else defaults
        return isinstance(node, DictConfig) and leaf in node.keys()  # noqa: SIM118 (`in node` is False for ???)

    _, overrides = split_command(dry_run(recipe))
    assert declared("actor_rollout_ref.rollout.name") and not declared("actor_rollout_ref.rollout.nam")
    assert [o for o in overrides if not o.startswith("+") and not declared(override_key(o))] == []
