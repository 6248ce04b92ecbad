"""Read torch's flight-recorder dumps and name the collective a job hung in.

Each rank's dump (TORCH_FR_DUMP_TEMP_FILE<rank>, written when the NCCL watchdog times out; the
envbuild images point it at a dump directory) lists the last collectives that rank scheduled:
process group, sequence number, op (`nccl:all_gather`), sizes, state, and whether it retired.
Torch writes it pickled, or as JSON (`_dump_fr_trace_json`). A dump comes from a crashed job,
often off a shared filesystem, so it is untrusted: the pickle is read by an unpickler that
builds only plain containers, strings and numbers (any class, global or persistent id is
refused, so nothing is imported or called), both forms are size-bounded, and every field is
type-checked before use.

The hung collective of a process group is the lowest sequence number some rank has not
completed; the ranks that never entered it are those whose last entry is older; ranks whose
entries at that number name another op called a different collective there.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from typing import Optional

from ..errors import EnvbuildError
from .ranks import file_rank
from .reading import read_regular

MAX_DUMP = 64 << 20  # a dump of 20,000 entries with stacks is about 20 MiB
MAX_ENTRIES = 100_000
MAX_REPORTED = 8
PICKLE_START = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
RANKS_TEXT = re.compile(r"^\[\s*(\d+(?:\s*,\s*\d+)*)?\s*,?\s*\]$")


def is_dump(head: bytes) -> bool:
    """Whether a file's first bytes look like a flight-recorder dump (pickled, or torch's JSON)."""
    return head.startswith(PICKLE_START) or (head.lstrip().startswith(b"{") and b'"entries"' in head)


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings, numbers, bools and None, and nothing else."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, and a dump holds only plain data")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it asks for a persistent object, and a dump holds only plain data")


def load_dump(path: str) -> dict:
    """The dump at PATH as plain data; EnvbuildError (exit 2) if it is not one."""
    data = read_regular(path, "flight-recorder dump", MAX_DUMP)
    try:
        if data.startswith(PICKLE_START):
            dump = _PlainUnpickler(io.BytesIO(data)).load()
        else:
            dump = json.loads(data.decode("utf-8"))
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise EnvbuildError(f"flight-recorder dump {path} cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
                            "Give the files torch wrote (TORCH_FR_DUMP_TEMP_FILE<rank>, pickled or JSON).") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise EnvbuildError(f"flight-recorder dump {path} has no list of entries; it is not a dump torch wrote.")
    return dump


def _int(value) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        return int(value)
    return None


def _text(value, limit: int = 200) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _sizes(value) -> str:
    if not isinstance(value, (list, tuple)):
        return "?"
    shapes = []
    for shape in value[:8]:
        dims = [str(d) for d in shape[:8] if _int(d) is not None] if isinstance(shape, (list, tuple)) else []
        shapes.append("[" + ", ".join(dims) + "]")
    return "[" + ", ".join(shapes) + ("…" if len(value) > 8 else "") + "]"


@dataclass
class Entry:
    pg: str
    pg_desc: str
    pg_id: Optional[int]
    seq: int
    op: str
    state: str
    retired: bool
    sizes: str
    p2p: bool


def _entries(dump: dict) -> tuple[list[Entry], int]:
    """The entries that have the fields this reads, and how many did not."""
    good, bad = [], 0
    for raw in dump["entries"][:MAX_ENTRIES]:
        if not isinstance(raw, dict):
            bad += 1
            continue
        group = raw.get("process_group")
        name, desc = (group[0], group[1]) if isinstance(group, (list, tuple)) and len(group) == 2 else ("", "")
        p2p = raw.get("is_p2p") is True
        seq = _int(raw.get("p2p_seq_id" if p2p else "collective_seq_id"))
        op = _text(raw.get("profiling_name"))
        if seq is None or not op:
            bad += 1
            continue
        good.append(Entry(_text(name), _text(desc), _int(raw.get("pg_id")), seq, op, _text(raw.get("state")),
                          raw.get("retired") is True, _sizes(raw.get("input_sizes")), p2p))
    return good, bad


def _members(dump: dict, pg: str, groups: set[str]) -> Optional[set[int]]:
    """The global ranks of process group `pg` from the dump's pg_config (None: not recorded)."""
    config = dump.get("pg_config")
    if not isinstance(config, dict):
        return None
    entry = config.get(pg)
    if entry is None and len(config) == 1 and len(groups) == 1:
        entry = next(iter(config.values()))  # gloo records its one group under an empty name
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    match = RANKS_TEXT.match(ranks.strip()) if isinstance(ranks, str) and len(ranks) < 1_000_000 else None
    if not match:
        return None
    return {int(r) for r in match.group(1).split(",")} if match.group(1) else set()


def _last_completed(dump: dict, pg_id: Optional[int]) -> Optional[int]:
    status = dump.get("pg_status")
    if not isinstance(status, dict) or pg_id is None:
        return None
    group = status.get(str(pg_id))
    return _int(group.get("last_completed_collective")) if isinstance(group, dict) else None


@dataclass
class Hang:
    """The collective one process group stopped at."""
    pg: str
    op: str
    seq: int
    sizes: str
    entered: list[int]
    never_entered: list[int]
    no_dump: list[int]
    others: dict[int, str] = field(default_factory=dict)  # rank -> the other op it called at this number
    last: dict[int, str] = field(default_factory=dict)  # never-entered rank -> its last op
    p2p: bool = False

    def as_dict(self) -> dict:
        return {"process_group": self.pg, "op": self.op, "seq": self.seq, "p2p": self.p2p, "sizes": self.sizes,
                "entered": self.entered, "never_entered": self.never_entered, "no_dump": self.no_dump,
                "other_op": {str(r): op for r, op in self.others.items()},
                "last_op_of_never_entered": {str(r): op for r, op in self.last.items()}}


@dataclass
class Recording:
    """What a directory of dumps says: the ranks read, the hangs, what could not be used."""
    ranks: list[int]
    hangs: list[Hang]
    version: str
    ignored_entries: int
    files: list[str]

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "version": self.version, "files": self.files,
                "ignored_entries": self.ignored_entries, "hangs": [h.as_dict() for h in self.hangs]}


def _done(entry: Entry, dump: dict) -> bool:
    """Completed: the state says so, or the group's status counts it completed (gloo records no
    state changes, only retirement and the last completed number)."""
    if entry.state == "completed":
        return True
    last = _last_completed(dump, entry.pg_id) if not entry.p2p else None
    return last is not None and entry.seq <= last


def _group_hang(pg: str, per_rank: dict[int, list[Entry]], dumps: dict[int, dict], members: set[int],
                p2p: bool) -> Optional[Hang]:
    firsts = {}
    for rank, entries in per_rank.items():
        pending = [e.seq for e in entries if not _done(e, dumps[rank])]
        if pending:
            firsts[rank] = min(pending)
    if not firsts:
        return None
    seq = min(firsts.values())
    at = {rank: next(e for e in entries if e.seq == seq) for rank, entries in per_rank.items()
          if any(e.seq == seq for e in entries)}
    entered = sorted(at)
    never = sorted(rank for rank, entries in per_rank.items()
                   if rank not in at and max(e.seq for e in entries) < seq)
    holder = min(firsts, key=lambda r: (firsts[r], r))
    reference = at[holder]
    ops: dict[str, list[int]] = {}
    for rank, entry in at.items():
        ops.setdefault(entry.op, []).append(rank)
    main_op = max(ops, key=lambda op: (len(ops[op]), op == reference.op))
    others = {rank: entry.op for rank, entry in at.items() if entry.op != main_op}
    last = {}
    for rank in never:
        latest = max(per_rank[rank], key=lambda e: e.seq)
        last[rank] = f"#{latest.seq} {latest.op}" + (" (completed)" if _done(latest, dumps[rank]) else "")
    sizes = next((e.sizes for r, e in at.items() if e.op == main_op), reference.sizes)
    return Hang(pg, main_op, seq, sizes, [r for r in entered if r not in others], never,
                sorted(members - set(dumps)), others, last, p2p)


def read_recording(paths: list[str], skipped: Optional[list] = None) -> Recording:
    """The hangs a set of per-rank dump files shows (the rank of each from its file name, as torch
    names them). A file that is not a usable dump is an error, or, given a `skipped` list (files
    found in a directory), listed there with the reason."""
    dumps: dict[int, dict] = {}
    files = []
    for path in paths:
        try:
            label = file_rank(re.sub(r"\.(?:json|pkl|pickle)$", "", path))
            if label is None:
                raise EnvbuildError(f"flight-recorder dump {path} does not end in its rank number; torch names "
                                    "them <prefix><rank> (TORCH_FR_DUMP_TEMP_FILE), e.g. rank_3.")
            rank = int(label.split()[-1])
            if rank in dumps:
                raise EnvbuildError(f"flight-recorder dumps {path} and another file both name rank {rank}; "
                                    "give one directory per job.")
            dumps[rank] = load_dump(path)
        except EnvbuildError as e:
            if skipped is None:
                raise
            skipped.append((path, e.message.split(";")[0].split(". ")[0].removeprefix(f"flight-recorder dump {path} ")))
            continue
        files.append(path)
    entries_of: dict[int, list[Entry]] = {}
    ignored = 0
    for rank, dump in dumps.items():
        entries_of[rank], bad = _entries(dump)
        ignored += bad
    groups: dict[tuple[str, bool], dict[int, list[Entry]]] = {}
    for rank, entries in entries_of.items():
        for entry in entries:
            groups.setdefault((entry.pg, entry.p2p), {}).setdefault(rank, []).append(entry)
    names = {pg for pg, _ in groups}
    hangs = []
    for (pg, p2p), per_rank in sorted(groups.items()):
        members = None
        for rank in per_rank:
            members = _members(dumps[rank], pg, names)
            if members is not None:
                break
        members = members if members is not None else set(dumps)
        # A member with a dump but no entry in this group entered none of its collectives.
        for rank in members & set(dumps) - set(per_rank):
            per_rank[rank] = []
        per_rank = {rank: entries for rank, entries in per_rank.items() if entries or rank in members}
        hang = _group_hang(_pg_name(pg, per_rank), {r: e for r, e in per_rank.items() if e}, dumps, members, p2p)
        if hang:
            hang.never_entered = sorted(set(hang.never_entered) | {r for r, e in per_rank.items() if not e})
            hangs.append(hang)
    version = next((_text(d.get("version"), 20) for d in dumps.values() if _text(d.get("version"), 20)), "?")
    return Recording(sorted(dumps), hangs[:MAX_REPORTED], version, ignored, files)


def _pg_name(pg: str, per_rank: dict[int, list[Entry]]) -> str:
    desc = next((e.pg_desc for entries in per_rank.values() for e in entries if e.pg_desc), "")
    return f"{pg} ({desc})" if desc and desc != pg else pg or "?"
