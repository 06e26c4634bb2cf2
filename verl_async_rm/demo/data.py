"""The demo's models and prompt files, built offline: what ``verl-async-rm demo`` trains on and what
``recipes/grpo_cpu_tiny.sh`` uses where ``POLICY_PATH``, ``RM_PATH``, ``TRAIN_FILE`` or ``VAL_FILE`` is unset.

- the policy: the tiny ``Qwen2ForCausalLM`` of :func:`verl_async_rm.testing.build_tiny_models` (ChatML template);
- the RM: :func:`verl_async_rm.demo.models.build_demo_rm`, whose score the policy can raise;
- ``train.parquet`` / ``val.parquet``: word problems in verl's RL dataset format (``data_source``, ``prompt`` as chat
  messages, ``ability``, ``reward_model.ground_truth``, ``extra_info.index`` and ``.question``), which
  ``RLHFDataset`` reads.

``python -m verl_async_rm.demo.data [CACHE_DIR]`` builds them (seconds, once) and prints ``KEY=path`` lines for the
recipe.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from verl_async_rm.testing.models import build_atomically, build_tiny_models, default_cache_dir

__all__ = ["DATA_SOURCE", "DemoAssets", "RM_HIDDEN_SIZE", "RM_LAYERS", "demo_assets", "write_prompt_files",
           "word_problems"]

#: ``data_source`` of every demo prompt (the rule reward and verl's metrics see it).
DATA_SOURCE = "demo/word_problems"
#: The demo RM's default size: about the cost of scoring a response, against the tiny policy's rollout, of a real RM.
RM_HIDDEN_SIZE, RM_LAYERS = 256, 4
_DATA_VERSION = "2"
_QUESTIONS = (
    "a farmer has {a} apples and sells {b}; how many are left?",
    "a book costs {a} dollars and a pen {b}; what is the total cost?",
    "a train goes {a} miles in {b} hours; what is its speed?",
    "each box holds {a} eggs; how many eggs are in {b} boxes?",
    "a class has {a} students and {b} teachers; how many people are there?",
    "she saves {a} dollars a week for {b} weeks; how much has she saved?",
)
_ANSWERS = (lambda a, b: a - b, lambda a, b: a + b, lambda a, b: a // b, lambda a, b: a * b, lambda a, b: a + b,
            lambda a, b: a * b)


@dataclass(frozen=True)
class DemoAssets:
    """Paths of the demo's policy, RM and prompt files."""

    policy: Path
    rm: Path
    train_file: Path
    val_file: Path

    def env(self) -> dict[str, str]:
        """The recipe's variables: ``POLICY_PATH``, ``RM_PATH``, ``TRAIN_FILE``, ``VAL_FILE``."""
        return {"POLICY_PATH": str(self.policy), "RM_PATH": str(self.rm), "TRAIN_FILE": str(self.train_file),
                "VAL_FILE": str(self.val_file)}


def demo_assets(cache_dir: str | Path | None = None, *, seed: int = 0, rm_hidden_size: int = RM_HIDDEN_SIZE,
                rm_layers: int = RM_LAYERS, train_prompts: int = 256, val_prompts: int = 8) -> DemoAssets:
    """Build (or reuse) the demo's models and prompt files under ``cache_dir`` (default:
    :func:`~verl_async_rm.testing.default_cache_dir`)."""
    from verl_async_rm.demo.models import build_demo_rm

    base = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).resolve()
    tiny = build_tiny_models(base, seed=seed)
    rm = build_demo_rm(tiny, hidden_size=rm_hidden_size, num_layers=rm_layers, seed=seed)
    folder = base / f"demo-data-v{_DATA_VERSION}-seed{seed}-{train_prompts}-{val_prompts}"
    build_atomically(folder, lambda tmp: write_prompt_files(tmp, seed=seed, train_prompts=train_prompts,
                                                            val_prompts=val_prompts),
                     {"seed": seed, "train": train_prompts, "val": val_prompts})
    return DemoAssets(policy=tiny.policy, rm=rm, train_file=folder / "train.parquet", val_file=folder / "val.parquet")


def _rows(split: str, count: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(count):
        kind = rng.randrange(len(_QUESTIONS))
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": _QUESTIONS[kind].format(a=a, b=b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(_ANSWERS[kind](a, b))},
            # the question again, as verl's own GSM8K preprocessing keeps it: a custom reward function sees extra_info,
            # not the prompt (the demo's verl_served mode renders the conversation for the RM from it)
            "extra_info": {"split": split, "index": i, "question": _QUESTIONS[kind].format(a=a, b=b)},
        })
    return rows


def word_problems(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` seeded word problems as the demo's prompt files hold them: (question, answer)."""
    return [(row["prompt"][0]["content"], row["reward_model"]["ground_truth"])
            for row in _rows("bench", count, random.Random(seed))]


def write_prompt_files(folder: str | Path, *, seed: int = 0, train_prompts: int = 256,
                       val_prompts: int = 8) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` (seeded word problems) into ``folder``."""
    import pandas as pd

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for split, count in (("train", train_prompts), ("val", val_prompts)):
        path = folder / f"{split}.parquet"
        pd.DataFrame(_rows(split, count, rng)).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_async_rm.demo.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", nargs="?", default=None, help="where to build (default: $VERL_ASYNC_RM_CACHE "
                                                                   "or ~/.cache/verl_async_rm)")
    args = parser.parse_args(argv)
    for key, value in demo_assets(args.cache_dir).env().items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
