"""``python -m bench.faults --repeat 20``: the fault scenarios of ``tests/integration/fault_scenarios.py``
run repeatedly on one real platform (redis-server, router, a prefill worker behind a KV proxy, two decode
workers), with a table of counts per scenario: requests sent, completed, failed with a clear status (by
code), hung (must be 0), blocks leaked and leases left open (must be 0), and any other problem found
(wrong tokens, a status the scenario does not allow, ...).

Run from the repository root (the scenarios live with the integration tests). A scenario that raises
(e.g. a worker that does not come back) is recorded as a problem and the platform is started afresh.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.fault_scenarios import SCENARIOS
from tests.integration.faults_lib import FaultPlatform, Reference, ScenarioResult

log = logging.getLogger("bench.faults")


@dataclass
class Tally:
    """One scenario's counts over all its runs."""

    runs: int = 0
    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    leaked_blocks: int = 0
    open_leases: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def add(self, result: ScenarioResult, seconds: float) -> None:
        self.runs += 1
        self.sent += len(result.outcomes)
        self.codes.update(result.codes)
        self.leaked_blocks += result.leaked_blocks
        self.open_leases += result.open_leases
        self.seconds += seconds
        self.problems += [f"run {self.runs}: {p}" for p in result.problems]

    def failed(self) -> str:
        clear = {code: n for code, n in sorted(self.codes.items()) if code not in ("OK", "HUNG")}
        return ", ".join(f"{n} {code}" for code, n in clear.items()) or "0"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs of each scenario (default: %(default)s)")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS),
                        help="which scenarios (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/faults.json"), help="JSON of the counts")
    parser.add_argument("--log-dir", type=Path, default=None, help="process logs (default: a temp folder)")
    parser.add_argument("--kv-layerwise", action="store_true",
                        help="the router streams KV layer by layer (PrefillStream + FirstToken) during the faults")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, work: Path) -> dict[str, Tally]:
    from engine.tiny import build_model

    model_dir = build_model("tiny", work / "tiny", train_steps=20, progress=lambda _: None)
    reference = Reference(model_dir)
    log_dir = args.log_dir or work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    tallies = {name: Tally() for name in args.scenarios}
    router_args = ("--kv-layerwise",) if args.kv_layerwise else ()
    platform = FaultPlatform.start(model_dir, log_dir, router_args)
    try:
        for i in range(args.repeat):
            for name in args.scenarios:
                started = time.monotonic()
                try:
                    result = SCENARIOS[name](platform, reference)
                except Exception as exc:  # noqa: BLE001 - recorded; the next run gets a fresh platform
                    result = ScenarioResult(name, problems=[f"raised {exc!r}"])
                    platform.stop()
                    platform = FaultPlatform.start(model_dir, log_dir, router_args)
                tallies[name].add(result, time.monotonic() - started)
                log.info("run %d/%d %s: %s%s", i + 1, args.repeat, name, dict(result.codes),
                         f" PROBLEMS {result.problems}" if result.problems else "")
    finally:
        platform.stop()
    return tallies


def table(tallies: dict[str, Tally]) -> str:
    rows = ["| scenario | runs | requests sent | completed | failed with a clear status | hung | blocks leaked "
            "| leases open | other problems | s/run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in tallies.items():
        rows.append(f"| {name} | {t.runs} | {t.sent} | {t.codes['OK']} | {t.failed()} | {t.codes['HUNG']} "
                    f"| {t.leaked_blocks} | {t.open_leases} | {len(t.problems)} | {t.seconds / max(t.runs, 1):.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="baton-bench-faults-") as work:
        tallies = run(args, Path(work))
    print(table(tallies))
    for name, t in tallies.items():
        for problem in t.problems:
            print(f"{name}: {problem}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({name: {"runs": t.runs, "sent": t.sent, "codes": dict(t.codes),
                                           "leaked_blocks": t.leaked_blocks, "open_leases": t.open_leases,
                                           "seconds": t.seconds, "problems": t.problems}
                                    for name, t in tallies.items()}, indent=2))
    bad = any(t.problems or t.codes["HUNG"] or t.leaked_blocks or t.open_leases for t in tallies.values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
