"""The causal-LM families discovery recognises, recorded per transformers version, and the check against it.

Holds:
    RECORDS: the folder of records, one JSON file per transformers minor version (``5.24.json``).
    discover: model_type -> the problems ``discovery.discover_spec`` finds on its tiny model (empty: recognised).
    record_for: the record that applies to a transformers version: its own, else the newest one below it.
    families: the model_types to check against a record: the installed transformers' and the recorded ones.
    lost: the recorded families discovery no longer recognises, each with the reasons it now gives.
    recognised_beyond: the families discovery recognises that the record does not list.
    describe_lost: the lost families as a message naming each family and its reasons.
    main: ``python -m tests.discovery_record [--write [--accept-lost]]`` compares with the record that applies,
        and writes this version's.

Why a record: discovery (``ds_longseq/families/discovery.py``, whose docstring lists what it relies on) reads
transformers' code, so a transformers release that rewrites a forward makes the family refused, never trained
wrong. The sweep (``tests/test_model_sweep.py``) counts a refusal as a pass and its pinned table is skipped on
a transformers it was not generated for, so such a loss would go unnoticed. ``test_discovery.py`` compares the
installed transformers with the record that applies and fails naming every family lost; families recognised
beyond the record are only reported.

After upgrading transformers: ``python -m tests.discovery_record`` shows what changed; fix discovery for every
family lost, then ``python -m tests.discovery_record --write`` records the new version (it refuses while any
recorded family is lost; ``--accept-lost`` drops them deliberately, e.g. a family transformers removed).

The families are the sweep's (``model_zoo.causal_lm_model_types``), each built from its tiny default config
(``model_zoo.untrained_model``): discovery reads structure and code only, so nothing runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import transformers
from packaging.version import Version

from ds_longseq.families import discovery
from ds_longseq.families.decoder import FamilySpec
from tests import model_zoo

__all__ = [
    "RECORDS", "COMMAND", "version_key", "discover", "record_for", "families", "lost", "recognised_beyond",
    "describe_lost", "write_record", "main",
]

RECORDS = Path(__file__).resolve().parent / "discovery_records"
COMMAND = "python -m tests.discovery_record --write"


def version_key(version: str) -> str:
    """``"5.24"`` for transformers ``5.24.0`` (a record holds for a minor version: patch releases keep models)."""
    parsed = Version(version)
    return f"{parsed.major}.{parsed.minor}"


def discover(model_types: list[str] | None = None) -> dict[str, list[str]]:
    """model_type -> the problems discovery finds on its tiny model, empty where it recognises it (default: every
    causal-LM ``model_type`` of the installed transformers). A model_type transformers no longer maps, or whose
    tiny model cannot be built, gets that as its problem."""
    mapped = set(model_zoo.causal_lm_model_types())
    outcomes: dict[str, list[str]] = {}
    for model_type in sorted(mapped) if model_types is None else model_types:
        if model_type not in mapped:
            outcomes[model_type] = [f"transformers {transformers.__version__} no longer has it as a causal-LM "
                                    "model_type (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"]
            continue
        try:
            model = model_zoo.untrained_model(model_type)
        except Exception as error:  # noqa: BLE001 - an unbuildable family is an outcome, reported with its type
            outcomes[model_type] = [f"its tiny model (tests/model_zoo.py) cannot be built: "
                                    f"{type(error).__name__}: {error}".strip()]
            continue
        outcomes[model_type] = discovery.discover_spec(model, FamilySpec)[1]
    return outcomes


def record_for(version: str, folder: Path | None = None) -> tuple[str, list[str]] | None:
    """``(key, recognised model_types)`` of the record for transformers ``version`` in ``folder`` (default
    :data:`RECORDS`): its own minor version's, else the newest one below it; None where every record is of a
    later version."""
    folder = RECORDS if folder is None else folder
    wanted = Version(version_key(version))
    keys = [Version(path.stem) for path in folder.glob("*.json")]
    older = [key for key in keys if key <= wanted]
    if not older:
        return None
    key = f"{max(older).major}.{max(older).minor}"
    return key, json.loads((folder / f"{key}.json").read_text())["recognised"]


def families(recorded: list[str]) -> list[str]:
    """Every causal-LM model_type of the installed transformers and every ``recorded`` one (a recorded family
    transformers no longer has counts as lost), sorted."""
    return sorted(set(model_zoo.causal_lm_model_types()) | set(recorded))


def lost(recorded: list[str], outcomes: dict[str, list[str]]) -> dict[str, list[str]]:
    """The recorded families that ``outcomes`` (from :func:`discover`, for at least these families) does not
    recognise, with the reasons discovery gives now."""
    return {model_type: outcomes[model_type] for model_type in sorted(recorded) if outcomes[model_type]}


def recognised_beyond(recorded: list[str], outcomes: dict[str, list[str]]) -> list[str]:
    """The families ``outcomes`` recognises that ``recorded`` does not list, sorted."""
    return sorted(family for family, problems in outcomes.items() if not problems and family not in recorded)


def describe_lost(gone: dict[str, list[str]], key: str) -> str:
    """A message naming each lost family, the reasons discovery now gives, and what to do."""
    lines = [f"discovery no longer recognises {len(gone)} famil{'y' if len(gone) == 1 else 'ies'} the transformers "
             f"{key} record (tests/discovery_records/{key}.json) lists:"]
    for model_type, reasons in gone.items():
        lines += [f"  {model_type}:"] + [f"    - {reason}" for reason in reasons]
    lines.append("Fix ds_longseq/families/discovery.py (its docstring lists what it relies on in transformers' code); "
                 f"drop a family from the record only on purpose ({COMMAND} --accept-lost).")
    return "\n".join(lines)


def write_record(outcomes: dict[str, list[str]], folder: Path | None = None) -> Path:
    """Write the installed transformers' record in ``folder`` (default :data:`RECORDS`): every family ``outcomes``
    recognises."""
    folder = RECORDS if folder is None else folder
    path = folder / f"{version_key(transformers.__version__)}.json"
    record = {
        "transformers": transformers.__version__,
        "written_by": COMMAND,
        "recognised": sorted(model_type for model_type, problems in outcomes.items() if not problems),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write this transformers version's record")
    parser.add_argument("--accept-lost", action="store_true",
                        help="with --write: drop the recorded families discovery no longer recognises")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # the tiny configs' deprecation warnings say nothing about discovery
    transformers.logging.set_verbosity_error()
    record = record_for(transformers.__version__)
    recorded = record[1] if record else []
    outcomes = discover(families(recorded))
    gone = lost(recorded, outcomes)
    new = recognised_beyond(recorded, outcomes)
    print(f"transformers {transformers.__version__}: {sum(not p for p in outcomes.values())} of {len(outcomes)} "
          f"families recognised; record {record[0] if record else 'none'}")
    if new:
        print(f"recognised beyond the record: {', '.join(new)}")
    if gone:
        print(describe_lost(gone, record[0]))
    if args.write and (not gone or args.accept_lost):
        print(f"wrote {write_record(outcomes)}")
    elif args.write:
        print("not written: recorded families are lost (see above)")
    return 1 if gone and not (args.write and args.accept_lost) else 0


if __name__ == "__main__":
    sys.exit(main())
