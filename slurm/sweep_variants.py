#!/usr/bin/env python3
"""Read the from-scratch sweep grid (configs/sweeps/grid.yaml): names, array index -> overrides.

    python slurm/sweep_variants.py list               # every variant, in array order
    python slurm/sweep_variants.py select transformer,swan-gpt   # check names (exit 2 on unknown)
    python slurm/sweep_variants.py overrides 3        # overrides of array task 3, one per line
    python slurm/sweep_variants.py overrides 1 --among transformer,swan-gpt   # task 1 of a subset
    python slurm/sweep_variants.py name 0 --among ... # the variant name of an array task
    python slurm/sweep_variants.py base               # the shared base config path
    python slurm/sweep_variants.py dump --among a,b   # "name<TAB>override override ..." per variant

Stdlib + PyYAML only (runs on a login node). Grid format::

    base: configs/sweeps/base_500m.yaml
    variants:
      - name: transformer
        overrides: [pretrain.arch=transformer, model.logits_scaling_a=null]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

DEFAULT_GRID = Path(__file__).resolve().parents[1] / "configs" / "sweeps" / "grid.yaml"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # also a folder name and a Slurm-safe word


class GridError(ValueError):
    """A malformed grid or an unknown variant; printed as one ``error:`` line, exit 2."""


def load_grid(path: str | Path) -> tuple[str, list[tuple[str, list[str]]]]:
    """``(base, [(name, overrides), ...])`` in file order, validated."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise GridError(f"cannot read the sweep grid {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise GridError(f"{path} is not valid YAML: {err}") from None
    if (not isinstance(data, dict) or not isinstance(data.get("variants"), list)
            or not data["variants"]):
        raise GridError(f"{path}: expected a mapping with a non-empty 'variants' list")
    variants, seen = [], set()
    for i, entry in enumerate(data["variants"]):
        where = f"{path}: variants[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise GridError(f"{where}: each variant needs a 'name' string")
        name = entry["name"]
        if not NAME_RE.match(name):
            raise GridError(f"{where}: name {name!r} must be letters, digits, '.', '_' or '-'")
        if name in seen:
            raise GridError(f"{where}: duplicate variant name {name!r}")
        seen.add(name)
        overrides = entry.get("overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o
                                                      for o in overrides):
            raise GridError(f"{where} ({name}): 'overrides' must be a list of key=value strings")
        variants.append((name, [o.strip() for o in overrides]))
    return str(data.get("base") or "configs/sweeps/base_500m.yaml"), variants


def select(variants: list[tuple[str, list[str]]], names: str | None) -> list[tuple[str, list[str]]]:
    """The variants named in the comma list ``names`` (in that order); all when empty or 'all'."""
    wanted = [n.strip() for n in (names or "").split(",") if n.strip()]
    if not wanted or wanted == ["all"]:
        return variants
    by_name = dict(variants)
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise GridError(f"unknown sweep variant(s) {', '.join(unknown)}; known: "
                        f"{', '.join(by_name)}")
    if len(set(wanted)) != len(wanted):
        raise GridError(f"a variant is named twice in {names!r}")
    return [(n, by_name[n]) for n in wanted]


def pick(variants: list[tuple[str, list[str]]], key: str) -> tuple[str, list[str]]:
    """A variant by array index (0-based) or by name."""
    if key.isdigit():
        index = int(key)
        if index >= len(variants):
            raise GridError(f"array index {index} is out of range: {len(variants)} variant(s) "
                            f"(0..{len(variants) - 1})")
        return variants[index]
    return select(variants, key)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sweep_variants.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command",
                   choices=("list", "count", "base", "select", "overrides", "name", "dump"))
    p.add_argument("arg", nargs="?",
                   help="select: comma list of names; overrides/name: array index or name")
    p.add_argument("--grid", default=str(DEFAULT_GRID),
                   help="grid YAML (default: configs/sweeps/grid.yaml)")
    p.add_argument("--among",
                   help="comma list of names the array index counts over (a HALO_VARIANTS subset)")
    args = p.parse_args(argv)
    try:
        base, variants = load_grid(args.grid)
        if args.command == "base":
            print(base)
            return 0
        pool = select(variants, args.among)
        if args.command == "dump":
            if any(any(c.isspace() for c in o) for _, ovs in pool for o in ovs):
                raise GridError("an override contains whitespace; write key=value without spaces")
            print("\n".join(f"{n}\t{' '.join(ovs)}" for n, ovs in pool))
        elif args.command in ("list", "count"):
            print(len(pool) if args.command == "count" else "\n".join(n for n, _ in pool))
        elif args.command == "select":
            print("\n".join(n for n, _ in select(variants, args.arg)))
        else:
            if args.arg is None:
                raise GridError(f"{args.command} needs an array index or a variant name")
            name, overrides = pick(pool, args.arg)
            print(name if args.command == "name" else "\n".join(overrides))
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
