"""``python -m deploycheck check | generate [--check] | exprs OUT | crd-schema CRD OUT``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from deploycheck import checks, crd, generate
from deploycheck.sources import Deploy
from workers.settings import ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploycheck", description=__doc__)
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository (default: this one)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="every check of deploy/; exit 1 on any problem")
    gen = sub.add_parser("generate", help="write the generated manifests")
    gen.add_argument("--check", action="store_true", help="only compare; exit 1 if one differs")
    exprs = sub.add_parser(
        "exprs", help="write every PromQL expression of deploy/ as recording rules (for promtool)"
    )
    exprs.add_argument("out", type=Path)
    crd_cmd = sub.add_parser("crd-schema", help="a strict JSON Schema from a CRD (deploycheck.crd)")
    crd_cmd.add_argument("crd", type=Path)
    crd_cmd.add_argument("out", type=Path)
    crd_cmd.add_argument(
        "--source", required=True, help="where the CRD comes from, and its version"
    )
    args = parser.parse_args(argv)
    deploy = Deploy(args.root.resolve())

    if args.command == "check":
        failed = 0
        for title, check in checks.CHECKS.items():
            problems = check(deploy)
            print(f"  {'ok  ' if not problems else 'FAIL'}  {title}")
            for problem in problems:
                print(f"        {problem}")
            failed += bool(problems)
        return 1 if failed else 0
    if args.command == "crd-schema":
        derived = crd.schema(yaml.safe_load(args.crd.read_text()), args.source)
        args.out.write_text(json.dumps(derived, indent=2) + "\n")
        return 0
    if args.command == "generate":
        if args.check:
            problems = checks.generated(deploy)
            for problem in problems:
                print(problem, file=sys.stderr)
            return 1 if problems else 0
        for path in generate.write(deploy):
            print(f"wrote {deploy.rel(path)}")
        return 0
    rules = [
        {"record": f"deploy:expr_{n}", "expr": e.text}
        for n, e in enumerate(deploy.expressions(), 1)
    ]
    args.out.write_text(yaml.safe_dump({"groups": [{"name": "deploy-exprs", "rules": rules}]}))
    print(f"{len(rules)} expressions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
