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
import pickle
import pickletools
import re
from dataclasses import dataclass, field
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.grammar import escaped
from envbuild.base.untrusted import loads_json
from envbuild.doctor.ranks import file_rank
from envbuild.doctor.reading import read_regular, size_text

MAX_DUMP = 64 << 20  # a dump of 20,000 entries with stacks is about 20 MiB
# Values one dump may hold, counted before it is parsed (JSON: from its bytes; a pickle: its
# opcodes, each of which makes at most one object or slot). A parsed value costs up to about 70
# bytes, so one dump costs at most about 300 MB while it is read; a real dump of torch's 2,000
# entries holds about 300,000, one of 20,000 entries with stacks about 2,700,000 opcodes.
DUMP_VALUES = 1 << 22
TOTAL_ENTRIES = 1 << 21  # entries kept over all dumps (about 200 bytes each): 1,000 ranks of 2,000
MAX_ENTRIES = 100_000
MAX_REPORTED = 8
PICKLE_START = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
RANKS_TEXT = re.compile(r"^\[\s*(\d{1,9}(?:\s*,\s*\d{1,9})*)?\s*,?\s*\]$")
INT_TEXT = re.compile(r"-?\d{1,18}")
TORCH_FILES = "Give the files torch wrote (TORCH_FR_DUMP_TEMP_FILE<rank>, pickled or JSON)."


class DumpRefused(EnvbuildError):
    """A file that is not a dump doctor can use; `why` says it without naming the file."""

    def __init__(self, path: str, why: str):
        super().__init__(f"flight-recorder dump {escaped(path)} {why}. {TORCH_FILES}")
        self.why = why


def is_dump(head: bytes) -> bool:
    """Whether a file's first bytes look like a flight-recorder dump (pickled, or torch's JSON)."""
    return head.startswith(PICKLE_START) or (head.lstrip().startswith(b"{") and b'"entries"' in head)


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings, numbers, bools and None, and nothing else."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, and a dump holds only plain data")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it asks for a persistent object, and a dump holds only plain data")


def _pickle_values(data: bytes, limit: int) -> int:
    """How many opcodes the pickle holds, counted no further than past `limit` (every opcode is
    at least a byte, so a short pickle needs no count)."""
    if len(data) <= limit:
        return len(data)
    count = 0
    for _ in pickletools.genops(data):
        count += 1
        if count > limit:
            break
    return count


def _load_pickle(data: bytes, path: str):
    if _pickle_values(data, DUMP_VALUES) > DUMP_VALUES:
        raise DumpRefused(path, f"holds more than {DUMP_VALUES} values ({size_text(len(data))} of pickle), more than "
                          "doctor reads from one dump")
    return _PlainUnpickler(io.BytesIO(data)).load()


def _first_line(error: BaseException) -> str:
    text = str(error)
    return escaped(text.splitlines()[0][:200]) if text.strip() else type(error).__name__


def load_dump(path: str) -> dict:
    """The dump at PATH as plain data; EnvbuildError (exit 2) if it is not one. A JSON dump goes
    through envbuild.base.untrusted (bytes, depth, integer digits and values bounded before a field
    is read); a pickle through an unpickler that makes no object but plain data, after its
    opcodes are counted."""
    data = read_regular(path, "flight-recorder dump", MAX_DUMP)
    try:
        if data.startswith(PICKLE_START):
            dump = _load_pickle(data, path)
        else:
            dump = loads_json(data, "it", MAX_DUMP, max_values=DUMP_VALUES)
    except DumpRefused:
        raise
    except EnvbuildError as e:
        why = e.message.split("; no document")[0].split("; give the")[0].removeprefix("it ")
        raise DumpRefused(path, f"cannot be read: it {why}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise DumpRefused(path, f"cannot be read: {_first_line(e)}") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise DumpRefused(path, "has no list of entries; it is not a dump torch wrote")
    return dump


def _int(value) -> Optional[int]:
    """A count or number as a dump holds it (an int, or its digits as text), within 64 bits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value.bit_length() < 64 else None
    if isinstance(value, str) and INT_TEXT.fullmatch(value):
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


@dataclass(slots=True)
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


def _entries(dump: dict, shared: dict) -> tuple[list[Entry], int]:
    """The entries that have the fields this reads, and how many did not; `shared` keeps one copy
    of each text (thousands of entries name the same group, op and state)."""
    good, bad = [], 0
    keep = shared.setdefault
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
        name, desc, op, state, sizes = (keep(t, t) for t in (_text(name), _text(desc), op, _text(raw.get("state")),
                                                            _sizes(raw.get("input_sizes"))))
        good.append(Entry(name, desc, _int(raw.get("pg_id")), seq, op, state, raw.get("retired") is True, sizes, p2p))
    return good, bad


@dataclass
class _Dump:
    """What doctor keeps of one rank's dump once it is read (the parsed document is let go): its
    usable entries, the members of the groups they name, those groups' last completed numbers."""
    entries: list[Entry]
    ignored: int
    members: dict[str, Optional[set[int]]]  # group name -> its global ranks (None: not recorded)
    single: Optional[set[int]]  # the members of the one group pg_config holds (gloo names it "")
    completed: dict[int, Optional[int]]  # pg_id -> pg_status' last_completed_collective
    version: str


def _ranks_of(entry) -> Optional[set[int]]:
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    match = RANKS_TEXT.match(ranks.strip()) if isinstance(ranks, str) and len(ranks) < 1_000_000 else None
    if not match:
        return None
    return {int(r) for r in match.group(1).split(",")} if match.group(1) else set()


def _compact(dump: dict, shared: dict) -> _Dump:
    entries, bad = _entries(dump, shared)
    config = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    members = {e.pg: _ranks_of(config[e.pg]) for e in entries if e.pg in config}
    single = _ranks_of(next(iter(config.values()))) if len(config) == 1 else None
    status = dump.get("pg_status") if isinstance(dump.get("pg_status"), dict) else {}
    completed = {}
    for pg_id in {e.pg_id for e in entries if e.pg_id is not None}:
        group = status.get(str(pg_id))
        completed[pg_id] = _int(group.get("last_completed_collective")) if isinstance(group, dict) else None
    return _Dump(entries, bad, members, single, completed, _text(dump.get("version"), 20))


def _members(dump: _Dump, pg: str, groups: set[str]) -> Optional[set[int]]:
    """The global ranks of process group `pg` from the dump's pg_config (None: not recorded)."""
    if pg in dump.members:
        return dump.members[pg]
    return dump.single if len(groups) == 1 else None  # gloo records its one group under an empty name


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
    unread: list[str] = field(default_factory=list)  # dumps that could not be read (each listed as skipped)
    unread_ranks: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "version": self.version, "files": self.files, "unread": self.unread,
                "unread_ranks": self.unread_ranks, "ignored_entries": self.ignored_entries,
                "hangs": [h.as_dict() for h in self.hangs]}


def _done(entry: Entry, dump: _Dump) -> bool:
    """Completed: the state says so, or the group's status counts it completed (gloo records no
    state changes, only retirement and the last completed number)."""
    if entry.state == "completed":
        return True
    last = dump.completed.get(entry.pg_id) if not entry.p2p else None
    return last is not None and entry.seq <= last


def _group_hang(pg: str, per_rank: dict[int, list[Entry]], dumps: dict[int, _Dump], members: set[int],
                p2p: bool, unread: set[int]) -> Optional[Hang]:
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
                sorted(members - set(dumps) - unread), others, last, p2p)


def _rank_of(path: str, dumps: dict) -> int:
    label = file_rank(re.sub(r"\.(?:json|pkl|pickle)$", "", path))
    if label is None:
        raise DumpRefused(path, "does not end in its rank number; torch names them <prefix><rank> "
                          "(TORCH_FR_DUMP_TEMP_FILE), e.g. rank_3")
    rank = int(label.split()[-1])
    if rank in dumps:
        raise DumpRefused(path, f"names rank {rank}, as another file does; give one directory per job")
    return rank


def _read_one(path: str, kept: int, shared: dict, budget) -> _Dump:
    """One dump within the run's budgets: the time (--max-seconds) and the entries kept over all dumps."""
    if budget is not None and budget.expired():
        raise DumpRefused(path, f"was not read: the time limit ({budget.max_seconds:g} s, --max-seconds) was spent")
    dump = _compact(load_dump(path), shared)
    if dump.ignored and not dump.entries:
        raise DumpRefused(path, f"holds {dump.ignored} entries and none with the fields torch writes (a sequence "
                          "number and an op); it is not a dump torch wrote")
    if kept + len(dump.entries) > TOTAL_ENTRIES:
        raise DumpRefused(path, f"was not read: its {len(dump.entries)} entries are over the {TOTAL_ENTRIES} doctor "
                          "keeps over all dumps; give fewer dumps at once")
    return dump


def _read_dumps(paths: list[str], skipped: Optional[list], budget) -> tuple[dict[int, _Dump], list[str], list, list]:
    """Each rank's dump; one that cannot be used is an error, or, given `skipped`, listed there."""
    dumps: dict[int, _Dump] = {}
    files, unread, unread_ranks = [], [], []
    kept, shared = 0, {}
    for path in paths:
        rank = None
        try:
            rank = _rank_of(path, dumps)
            dumps[rank] = _read_one(path, kept, shared, budget)
        except EnvbuildError as e:
            if skipped is None:
                raise
            skipped.append((path, e.why if isinstance(e, DumpRefused) else e.message.split(";")[0]))
            unread.append(path)
            if rank is not None and rank not in dumps:
                unread_ranks.append(rank)
            continue
        kept += len(dumps[rank].entries)
        files.append(path)
    return dumps, files, unread, sorted(set(unread_ranks))


def read_recording(paths: list[str], skipped: Optional[list] = None, budget=None) -> Recording:
    """The hangs a set of per-rank dump files shows (the rank of each from its file name, as torch
    names them). A file that is not a usable dump is an error, or, given a `skipped` list (files
    found in a directory), listed there with the reason; a rank whose dump was not read is never
    called one that wrote none."""
    dumps, files, unread, unread_ranks = _read_dumps(paths, skipped, budget)
    groups: dict[tuple[str, bool], dict[int, list[Entry]]] = {}
    for rank, dump in dumps.items():
        for entry in dump.entries:
            groups.setdefault((entry.pg, entry.p2p), {}).setdefault(rank, []).append(entry)
    names = {pg for pg, _ in groups}
    hangs = []
    for (pg, p2p), per_rank in sorted(groups.items()):
        members = next((m for m in (_members(dumps[rank], pg, names) for rank in per_rank) if m is not None), None)
        members = members if members is not None else set(dumps)
        # A member with a dump but no entry in this group entered none of its collectives.
        for rank in members & set(dumps) - set(per_rank):
            per_rank[rank] = []
        per_rank = {rank: entries for rank, entries in per_rank.items() if entries or rank in members}
        hang = _group_hang(_pg_name(pg, per_rank), {r: e for r, e in per_rank.items() if e}, dumps, members, p2p,
                           set(unread_ranks))
        if hang:
            hang.never_entered = sorted(set(hang.never_entered) | {r for r, e in per_rank.items() if not e})
            hangs.append(hang)
    version = next((d.version for d in dumps.values() if d.version), "?")
    return Recording(sorted(dumps), hangs[:MAX_REPORTED], version, sum(d.ignored for d in dumps.values()), files,
                     unread, unread_ranks)


def _pg_name(pg: str, per_rank: dict[int, list[Entry]]) -> str:
    desc = next((e.pg_desc for entries in per_rank.values() for e in entries if e.pg_desc), "")
    return f"{pg} ({desc})" if desc and desc != pg else pg or "?"
