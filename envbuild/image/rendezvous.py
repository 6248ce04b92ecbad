"""Where this rank stands in a multi-node job and how it reaches rank 0: the launcher's
variables (torchrun's, else srun's, with Slurm's compact hostlist expanded) as a
:class:`Rendezvous`, then the TCP store rank 0 serves. The first phase of ``smoke.py
--multinode`` (multinode.py), and the one whose mistakes are usage errors (exit 2).
"""

from __future__ import annotations

import os
import socket
import time

from .manifest import UsageError

TORCH_DEFAULT_PORT = 29500  # torchrun's --master-port default
SLURM_PORT_BASE = 15000  # PyTorch Lightning's SLURM convention: 15000 + the job id's last 4 digits
STORE_PREFIX = "envbuild-multinode"

USAGE = ("smoke.py --multinode: no rendezvous variables are set, so this process cannot know its rank "
         "or where rank 0 is. Start one process per rank the way the job starts, e.g. "
         "`torchrun --nnodes 2 --nproc-per-node 8 --node-rank I --master-addr HOST --master-port 29500 "
         "/opt/envbuild/smoke.py --multinode` on each node, or `srun --ntasks-per-node 8 python "
         "/opt/envbuild/smoke.py --multinode` in an allocation (rank 0's host is the first of "
         "SLURM_JOB_NODELIST), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (LOCAL_RANK picks the "
         "GPU) yourself. Without them, run the single-node smoke test: drop --multinode.")


# ----------------------------------------------------------------------------- the launcher's variables
def _slurm_range(text: str, whole: str) -> list[str]:
    """One bracket entry ('01-03' or '7'), zero-padded to its lower bound's width as Slurm does."""
    low, _, high = text.partition("-")
    if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
        raise UsageError(f"SLURM nodelist {whole!r}: bad range {text!r} (expected N or N-M with N <= M)")
    return [str(i).zfill(len(low)) for i in range(int(low), int(high or low) + 1)]


def _expand_one(pattern: str, whole: str) -> list[str]:
    """Expand one host pattern; several bracket groups expand left to right (a cartesian product)."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise UsageError(f"SLURM nodelist {whole!r}: unbalanced ']'")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise UsageError(f"SLURM nodelist {whole!r}: unbalanced '['")
    head, ranges, tail = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    numbers = [n for part in ranges.split(",") for n in _slurm_range(part.strip(), whole)]
    return [head + n + rest for n in numbers for rest in _expand_one(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact hostlist as hosts, in order (what `scontrol show hostnames` prints).

    >>> expand_hostlist("node[01-03,7],login1")
    ['node01', 'node02', 'node03', 'node7', 'login1']
    >>> expand_hostlist("rack[1-2]-gpu[3,5]")
    ['rack1-gpu3', 'rack1-gpu5', 'rack2-gpu3', 'rack2-gpu5']
    """
    hosts, depth, start = [], 0, 0
    for at, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1) or (at == len(text) and depth):
            raise UsageError(f"SLURM nodelist {text!r}: unbalanced {'[' if depth > 0 else ']'!r}")
        if char == "," and depth == 0:
            item = text[start:at].strip()
            if item:
                hosts.extend(_expand_one(item, text))
            start = at + 1
    return hosts


def slurm_port(job_id: str) -> int:
    """A port every rank of a Slurm job derives alike: 15000 + the job id's last four digits.

    PyTorch Lightning's convention (src/lightning/fabric/plugins/environments/slurm.py), so two
    jobs sharing a node rarely collide.
    >>> slurm_port("7099018")
    24018
    """
    return SLURM_PORT_BASE + int(job_id.strip()[-4:])


class Rendezvous:
    """Where this rank stands: rank, world size, local rank, rank 0's address, and who said so."""

    def __init__(self, rank, world_size, local_rank, master_addr, master_port, launcher, notes=()):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.launcher, self.notes = launcher, list(notes)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "master": f"{self.master_addr}:{self.master_port}", "launcher": self.launcher, "notes": self.notes}


def _int_var(environ, name: str, minimum: int = 0) -> int:
    value = environ.get(name, "").strip()
    if not value.isdigit() or int(value) < minimum:
        raise UsageError(f"smoke.py --multinode: {name}={value!r} is not a whole number >= {minimum}")
    return int(value)


def _first(environ, *names):
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None, None


def rendezvous_from_env(environ=None) -> Rendezvous:
    """torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) win; else srun's (SLURM_PROCID,
    SLURM_NTASKS, the first host of the step's or job's nodelist, a port from SLURM_JOB_ID);
    else a UsageError. MASTER_ADDR / MASTER_PORT set by the user override what Slurm implies."""
    env = os.environ if environ is None else environ
    notes = []
    if env.get("RANK") or env.get("WORLD_SIZE"):
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if not env.get(name, "").strip()]
        if missing:
            raise UsageError(f"smoke.py --multinode: RANK/WORLD_SIZE are set but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not: set {missing[0]} (rank 0's host for "
                             "MASTER_ADDR), as torchrun does")
        rank, world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE", 1)
        _, local = _first(env, "LOCAL_RANK", "SLURM_LOCALID")
        addr = env["MASTER_ADDR"].strip()
        launcher = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "env"
    elif env.get("SLURM_PROCID"):
        rank = _int_var(env, "SLURM_PROCID")
        count_var, _ = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        if not count_var:
            raise UsageError("smoke.py --multinode: SLURM_PROCID is set but SLURM_NTASKS is not: run it under "
                             "srun (one task per rank), not in the batch script itself")
        world = _int_var(env, count_var, 1)
        local = env.get("SLURM_LOCALID")
        list_var, nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if env.get("MASTER_ADDR", "").strip():
            addr = env["MASTER_ADDR"].strip()
        elif nodelist:
            hosts = expand_hostlist(nodelist)
            if not hosts:
                raise UsageError(f"smoke.py --multinode: {list_var}={nodelist!r} names no host")
            addr = hosts[0]
            notes.append(f"MASTER_ADDR {addr}: the first host of {list_var}={nodelist}")
        else:
            raise UsageError("smoke.py --multinode: under Slurm but neither SLURM_JOB_NODELIST nor MASTER_ADDR "
                             "is set: set MASTER_ADDR to rank 0's host")
        launcher = "srun"
    else:
        raise UsageError(USAGE)
    if rank >= world:
        raise UsageError(f"smoke.py --multinode: rank {rank} is outside a world of {world} ranks (0..{world - 1})")
    if env.get("MASTER_PORT", "").strip():
        port = _int_var(env, "MASTER_PORT", 1)
    elif launcher == "srun" and env.get("SLURM_JOB_ID", "").strip()[-4:].isdigit():
        port = slurm_port(env["SLURM_JOB_ID"])
        notes.append(f"MASTER_PORT {port}: derived from SLURM_JOB_ID={env['SLURM_JOB_ID'].strip()}")
    else:
        port = TORCH_DEFAULT_PORT
        notes.append(f"MASTER_PORT {port}: torchrun's default (MASTER_PORT unset)")
    if port > 65535:
        raise UsageError(f"smoke.py --multinode: MASTER_PORT={port} is not a TCP port (1..65535)")
    local_rank = int(local) if local and local.strip().isdigit() else 0
    return Rendezvous(rank, world, local_rank, addr, port, launcher, notes)


# ----------------------------------------------------------------------------- the store
def wait_for_port(addr: str, port: int, seconds: float, poll: float = 0.5) -> str:
    """Wait until something accepts TCP connections at addr:port; '' then, else why not.

    torch's TCPStore client retries past its own timeout (20 s for 8 here), so the deadline is
    kept here, with the stdlib, and the reason is told apart: no such host, nothing listening,
    or no answer at all.
    >>> wait_for_port("127.0.0.1", 1, 0.3).startswith("nothing accepts connections at 127.0.0.1:1")
    True
    """
    deadline = time.monotonic() + seconds
    why = ""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.2, min(2.0, left))):
                return ""
        except socket.gaierror as error:
            why = f"{addr!r} does not resolve ({error.strerror or error})"
        except ConnectionRefusedError:
            why = f"nothing accepts connections at {addr}:{port} (refused)"
        except OSError as error:
            why = f"{addr}:{port} does not answer ({error.strerror or type(error).__name__})"
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        time.sleep(min(poll, left))


def connect_store(rdzv: Rendezvous, timeout: float, environ=None):
    """The rendezvous store: rank 0 serves it at MASTER_ADDR:MASTER_PORT, unless torchrun's agent
    already does (TORCHELASTIC_USE_AGENT_STORE, the check torch's env:// rendezvous makes)."""
    from datetime import timedelta

    import torch.distributed as dist

    env = os.environ if environ is None else environ
    agent = (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR") == rdzv.master_addr
             and env.get("MASTER_PORT") == str(rdzv.master_port))
    if rdzv.rank != 0 or agent:
        why = wait_for_port(rdzv.master_addr, rdzv.master_port, timeout)
        if why:
            raise ConnectionError(why)
    store = dist.TCPStore(host_name=rdzv.master_addr, port=rdzv.master_port, world_size=rdzv.world_size,
                          is_master=rdzv.rank == 0 and not agent, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False, multi_tenant=True)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{STORE_PREFIX}/{attempt}/", store)
