"""Command-line interface: ``verl-async-rm {demo,bench,doctor}`` (also ``python -m verl_async_rm``)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _cmd_demo(args: argparse.Namespace) -> int:
    from verl_async_rm.demo import run_demo
    from verl_async_rm.demo.cli import config_from_args, report

    # a SIGTERM (``kill``, a CI timeout) unwinds like Ctrl-C, so the running mode's clean-up stops its main_ppo run
    # (a session of its own, which a signal to the demo's process group does not reach)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = run_demo(config_from_args(args))
    print(report(result))
    return 0


#: ``bench <name> [...]``: the module of ``verl_async_rm.bench`` that runs it, with a parser of its own: the batcher
#: micro-benchmark, the RM scorer's forwards on this device, a judge's two readouts, a group judge against a
#: per-response one, where to put the RM (a model), a remote judge (the plugin vs verl's rate_limited manager, with
#: faults), a pairwise judge's plans and aggregates against the others (a simulated judge). ``bench [...]``: the
#: overlap benchmark (``report``).
_BENCHES = {"batcher": "batcher", "rm": "rm", "judge": "judge", "group-judge": "group_judge", "layout": "layout",
            "remote": "remote", "pairwise": "pairwise"}


#: ``bench --help``: what each benchmark answers.
_BENCH_HELP = """benchmarks (each takes --help):
  bench [options]      the overlap benchmark: one simulated rollout step scored as trajectories finish, against
                       scoring after the rollout and the best any scheduler could do (no GPU, about a minute)
  bench batcher        the RM service's batcher: per-request overhead, fill, lateness
  bench rm             an RM's forwards on this device: packed, padded, shared prompts, vLLM
  bench judge          a judge's two readouts (logits, generate) on one model
  bench group-judge    a group judge against a per-response judge on the same trajectories
  bench layout         where to put the RM: a model of one step per layout (modelled, not measured)
  bench remote         a judge at an endpoint: the plugin against verl's rate_limited manager, with faults
                       (--kind outcome: an outcome RM's batched /classify against one request per trajectory)
  bench pairwise       a pairwise judge's plans and aggregates against a per-response and a group judge
                       (a simulated judge: no model runs)"""


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.rest[:1] in (["-h"], ["--help"]):  # the menu, then the overlap benchmark's own options
        from verl_async_rm.bench.report import build_parser as overlap_parser

        parser = overlap_parser()
        parser.description = ("The overlap benchmark (`verl-async-rm bench [options]`); the other benchmarks are "
                              "named first (`verl-async-rm bench rm --help`...).")
        parser.epilog = _BENCH_HELP
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        print(parser.format_help())
        return 0
    name = _BENCHES.get(args.rest[0]) if args.rest else None
    bench = importlib.import_module(f"verl_async_rm.bench.{name or 'report'}")
    status, report = bench.main(args.rest[1:] if name else args.rest)
    print(report)
    return status


def _cmd_doctor(args: argparse.Namespace) -> int:
    from verl_async_rm.doctor import report

    status, text = report(overrides=args.overrides)
    print(text)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-async-rm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="GRPO with verl's own main_ppo on this CPU machine, per mode: the plugin, "
                                       "verl's served RM, the plugin on the policy's GPU, no RM; time per phase and "
                                       "the RM score learnt")
    from verl_async_rm.demo.cli import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)

    # prefix_chars="+": every option after `bench` goes, unparsed, to the chosen benchmark's own parser.
    bench = sub.add_parser("bench", add_help=False, prefix_chars="+",
                           help="the overlap benchmark (`bench --help`), `bench batcher`, `bench rm`, `bench judge`, "
                                "`bench group-judge`, `bench layout`, `bench remote` or `bench pairwise` "
                                "(`bench rm --help`...)")
    bench.add_argument("rest", nargs=argparse.REMAINDER,
                       help="[batcher|rm|judge|group-judge|layout|remote|pairwise] and the benchmark's options")
    bench.set_defaults(func=_cmd_bench)

    doctor = sub.add_parser(
        "doctor", help="check the installed verl, the devices and, given a main_ppo command's overrides, that command "
                       "(no Ray, no weights loaded); exit status 1 on a problem",
        description="Versions, CUDA and GPUs, vLLM's build, the varlen kernel, and every touch point of verl the "
                    "plugin uses. With the overrides of a `python -m verl.trainer.main_ppo` command (as you would "
                    "type them, --config-path and --config-name included), that command's config is composed and "
                    "checked by verl's validate_config and the plugin's checks, each problem printed with its fix; "
                    "nothing starts Ray, loads weights or asks an endpoint.")
    doctor.add_argument("overrides", nargs=argparse.REMAINDER, metavar="OVERRIDE",
                        help="the command's Hydra overrides, e.g. trainer.n_gpus_per_node=6 "
                             "reward.reward_model.model_path=/models/rm")
    doctor.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"] and not {"-h", "--help"} & set(argv[1:]):  # a command's words, Hydra's flags included
        return _cmd_doctor(argparse.Namespace(overrides=argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
