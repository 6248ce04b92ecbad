"""One grammar per kind of value that reaches a generated file or a job script, checked where the
value enters (a CLI option, a project file, a matrix file) and again where it is written.

Each check returns the value, or raises :class:`GrammarError` (a ``ValueError``: pydantic's
field validators report it with the field's path) with a reason that names no input; the
caller names it (:func:`refuse` turns a reason into the one-paragraph EnvbuildError). Image
references have their grammar in :mod:`envbuild.oci.registry` and URLs in :mod:`envbuild.knowledge.validate`.

>>> slurm_time("2-12:00:00"), shell_words("train.py --lr 1e-4 --name 'a b'")
('2-12:00:00', ['train.py', '--lr', '1e-4', '--name', 'a b'])
>>> env_value("a\\nRUN id")
Traceback (most recent call last):
...
envbuild.base.grammar.GrammarError: it holds the control character '\\n'; an environment value is one line of text
"""

from __future__ import annotations

import re
import shlex

from envbuild.base.errors import EnvbuildError


class GrammarError(ValueError):
    """A value outside its grammar; the message says why, without naming the input."""


def shown(value: str, limit: int = 80) -> str:
    """A value as a message quotes it: control characters escaped (a message is one paragraph),
    cut at `limit` characters.

    >>> shown("1:00\\n#SBATCH --wrap=id")
    "'1:00\\\\n#SBATCH --wrap=id'"
    """
    return "'" + escaped(value if len(value) <= limit else value[:limit] + "...") + "'"


def escaped(text: str, keep: str = "") -> str:
    """`text` with its control characters, but those in `keep`, written as escapes: a value's
    carriage return or ESC cannot move the cursor or recolour the terminal."""
    return "".join(repr(c)[1:-1] if _control(c) and c not in keep else c for c in text)


def refuse(what: str, value: str, reason: str, choice: str) -> EnvbuildError:
    """The one-paragraph error (exit 2) for `value` of `what` (an option or a field) outside its
    grammar: why, and the nearest valid choice."""
    return EnvbuildError(f"{what} {shown(value)}: {reason}; {choice}")


def _control(c: str) -> bool:
    return ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"


def control_characters(text: str) -> list[str]:
    """The control characters in `text` (a newline, a tab, NUL, DEL, C1), each once."""
    return sorted({c for c in text if _control(c)})


def one_line(value: str, what: str = "a value") -> str:
    """Text that one line of a generated file holds (a comment, a label, a help line): no
    control character, which would end the line and start an instruction of its own."""
    bad = control_characters(value)
    if bad:
        raise GrammarError(f"it holds the control character{'s' if len(bad) > 1 else ''} "
                           f"{' '.join(repr(c) for c in bad)}; {what} is one line of text")
    return value


# ---------------------------------------------------------------- environment variables

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# '$', '"', '\\' and '`' break Dockerfile ENV quoting (Docker substitutes $NAME even in quotes);
# '}' and "'" break the Apptainer %environment line NAME="${NAME:-value}" (bash reads it).
ENV_FORBIDDEN = '$"\\`}\''
# execve(2): one "NAME=value" string may be at most MAX_ARG_STRLEN (32 pages: 131072 bytes on
# Linux); a longer one makes every process start fail with E2BIG.
MAX_ARG_STRLEN = 131072


def env_name(value: str) -> str:
    """An environment variable name as the shell and Docker take it."""
    if not ENV_NAME.match(value):
        raise GrammarError("it is not an environment variable name (letters, digits and '_', not starting with a "
                           "digit)")
    return value


def env_value(value: str, name: str = "NAME") -> str:
    """A value written into a Dockerfile ENV line and Apptainer's %environment shell code."""
    one_line(value, "an environment value")
    bad = sorted(set(value) & set(ENV_FORBIDDEN))
    if bad:
        raise GrammarError(f"it holds {' '.join(repr(c) for c in bad)}, which Dockerfile ENV lines and Apptainer's "
                           f"%environment shell code would read as code, not text; an environment value is plain text")
    size = len(f"{name}={value}".encode())
    if size >= MAX_ARG_STRLEN:
        raise GrammarError(f"{name}=VALUE is {size} bytes, and the kernel passes at most {MAX_ARG_STRLEN - 1} per "
                           f"variable (execve(2), MAX_ARG_STRLEN): no process could start with it")
    return value


# ---------------------------------------------------------------- paths

PATH_MAX = 4096  # linux/limits.h: a path, in bytes, with its NUL
NAME_MAX = 255   # linux/limits.h: one component, in bytes
PATH_WORD = re.compile(r"^[A-Za-z0-9._+@%=,:/~-]+\Z")  # what COPY, %files and a shell word take unquoted


def path(value: str, absolute: bool = False) -> str:
    """A file path: one line, within the kernel's limits, absolute where asked, no '..'."""
    one_line(value, "a path")
    if not value:
        raise GrammarError("it is empty")
    if len(value.encode()) >= PATH_MAX:
        raise GrammarError(f"it is {len(value.encode())} bytes long and a path is at most {PATH_MAX - 1} "
                           f"(linux/limits.h PATH_MAX)")
    long = next((part for part in value.split("/") if len(part.encode()) > NAME_MAX), None)
    if long:
        raise GrammarError(f"its component '{long[:40]}...' is {len(long.encode())} bytes long and a file name is at "
                           f"most {NAME_MAX} (linux/limits.h NAME_MAX)")
    if absolute and (not value.startswith("/") or ".." in value.split("/")):
        raise GrammarError("it is not an absolute path without '..'")
    return value


def path_word(value: str) -> str:
    """A path inside an image that build files write unquoted (COPY, %files, a step's argument):
    :func:`path`, absolute, of letters, digits and ``._+@%=,:/~-`` only."""
    path(value, absolute=True)
    if not PATH_WORD.match(value):
        bad = sorted({c for c in value if not PATH_WORD.match(c)})
        raise GrammarError(f"it holds {' '.join(repr(c) for c in bad)}; an image path is letters, digits and "
                           f"._+@%=,:/~- only")
    return value


# ---------------------------------------------------------------- Slurm

# sbatch(1) --time: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
# "days-hours:minutes", "days-hours:minutes:seconds" (slurm.schedmd.com/sbatch.html#OPT_time),
# or UNLIMITED/INFINITE; src/common/parse_time.c time_str2secs adds them up in a C int.
_SLURM_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                         r"|(?P<h>\d+):(?P<hm>\d+):(?P<hs>\d+)|(?P<m>\d+)(?::(?P<ms>\d+))?)\Z")
SLURM_UNLIMITED = ("UNLIMITED", "INFINITE")
INT_MAX = 2**31 - 1


def slurm_time(value: str) -> str:
    """A Slurm time limit (sbatch --time) Slurm can read.

    >>> slurm_time("forever")
    Traceback (most recent call last):
    ...
    envbuild.base.grammar.GrammarError: it is not a Slurm time limit: sbatch takes MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS (e.g. 24:00:00, 2-00:00:00), or UNLIMITED
    """
    if value.upper() in SLURM_UNLIMITED:
        return value
    found = _SLURM_TIME.match(value)
    if not found:
        raise GrammarError("it is not a Slurm time limit: sbatch takes MINUTES, MINUTES:SECONDS, "
                           "HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS "
                           "(e.g. 24:00:00, 2-00:00:00), or UNLIMITED")
    n = {k: int(v) for k, v in found.groupdict().items() if v is not None}
    seconds = (n.get("d", 0) * 86400 + (n.get("dh", 0) + n.get("h", 0)) * 3600
               + (n.get("dm", 0) + n.get("hm", 0) + n.get("m", 0)) * 60 + n.get("ds", 0) + n.get("hs", 0)
               + n.get("ms", 0))
    if seconds > INT_MAX:
        raise GrammarError(f"it is {seconds // 86400} days, more than Slurm can hold (it counts a time limit in "
                           f"seconds in a C int: at most {INT_MAX // 86400} days, src/common/parse_time.c)")
    return value


def count(value: int, low: int, high: int, why: str) -> int:
    """A whole number from `low` to `high`; `why` says where the upper bound comes from."""
    if value < low:
        raise GrammarError(f"it is below {low}")
    if value > high:
        raise GrammarError(f"it is above {high:,} ({why})")
    return value


# ---------------------------------------------------------------- shell words


def shell_words(value: str) -> list[str]:
    """A command line split as a POSIX shell splits it (quotes group, nothing is expanded): what
    a job script hands the program, each word quoted again for every shell it passes."""
    if "\0" in value:
        raise GrammarError("it holds a NUL byte, which no command-line argument can")
    try:
        words = shlex.split(value)
    except ValueError as e:
        raise GrammarError(f"it cannot be split into words ({e}: close the quote)") from None
    if not words:
        raise GrammarError("it holds no command")
    return words



# ---------------------------------------------------------------- Kubernetes

# k8s.io/apimachinery/pkg/util/validation/validation.go: what the API server accepts.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
DNS_LABEL_MAX = 63        # DNS1123LabelMaxLength
DNS_SUBDOMAIN_MAX = 253   # DNS1123SubdomainMaxLength
LABEL_VALUE_MAX = 63      # LabelValueMaxLength (also a qualified name's name part)


def dns_label(value: str, limit: int = DNS_LABEL_MAX) -> str:
    """A DNS-1123 label (a Service, a namespace, a container's name): lower-case letters, digits
    and '-', starting and ending with a letter or digit, at most `limit` characters.

    >>> dns_label("Train")
    Traceback (most recent call last):
    ...
    envbuild.base.grammar.GrammarError: it is not a DNS-1123 label (lower-case letters, digits and '-', starting and ending with a letter or digit)
    """
    one_line(value, "a name")
    if len(value) > limit:
        raise GrammarError(f"it is {len(value)} characters long and this name is at most {limit}")
    if not _DNS_LABEL.match(value):
        raise GrammarError("it is not a DNS-1123 label (lower-case letters, digits and '-', starting and ending with "
                           "a letter or digit)")
    return value


def dns_subdomain(value: str) -> str:
    """A DNS-1123 subdomain (a cluster domain, a label key's prefix): DNS-1123 labels joined by
    '.', at most 253 characters."""
    one_line(value, "a domain")
    if len(value) > DNS_SUBDOMAIN_MAX:
        raise GrammarError(f"it is {len(value)} characters long and a DNS-1123 subdomain is at most {DNS_SUBDOMAIN_MAX}")
    for part in value.split("."):
        try:
            dns_label(part)
        except GrammarError:
            raise GrammarError("it is not a DNS-1123 subdomain (labels of lower-case letters, digits and '-', joined "
                               "by '.')") from None
    return value


def qualified_name(value: str) -> str:
    """A Kubernetes qualified name (a label key, an extended resource's name): an optional DNS-1123
    subdomain prefix and '/', then at most 63 letters, digits, '-', '_' and '.', starting and
    ending with a letter or digit."""
    one_line(value, "a key")
    prefix, slash, name = value.rpartition("/")
    if slash:
        if not prefix:
            raise GrammarError("its prefix before '/' is empty")
        dns_subdomain(prefix)
    if len(name) > LABEL_VALUE_MAX or not _QUALIFIED_NAME.match(name):
        raise GrammarError(f"it is not a qualified name ([prefix/]name, the name at most {LABEL_VALUE_MAX} letters, "
                           f"digits, '-', '_' and '.', starting and ending with a letter or digit)")
    return value


def label_value(value: str) -> str:
    """A Kubernetes label value: empty, or at most 63 letters, digits, '-', '_' and '.', starting
    and ending with a letter or digit."""
    one_line(value, "a label value")
    if len(value) > LABEL_VALUE_MAX or not _LABEL_VALUE.match(value):
        raise GrammarError(f"it is not a label value (at most {LABEL_VALUE_MAX} letters, digits, '-', '_' and '.', "
                           f"starting and ending with a letter or digit)")
    return value


def extended_resource(value: str) -> str:
    """An extended resource a device plugin advertises (``nvidia.com/gpu``, ``rdma/shared_ib``):
    a qualified name with a domain prefix outside kubernetes.io (a device plugin's resource is
    always prefixed, and *.kubernetes.io names are the API server's own)."""
    qualified_name(value)
    prefix = value.rpartition("/")[0]
    if not prefix:
        raise GrammarError("it has no domain prefix (a device plugin's resource is DOMAIN/NAME, e.g. rdma/shared_ib)")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        raise GrammarError("its prefix is Kubernetes' own (kubernetes.io), which no device plugin may use")
    return value


_QUANTITY = re.compile(r"^(0|[1-9][0-9]{0,17})(Ki|Mi|Gi|Ti|Pi)?\Z")


def quantity(value: str) -> str:
    """A Kubernetes quantity as envbuild writes one: a whole number and an optional binary suffix
    (64Gi); what resource.MustParse reads exactly, without decimal or exponent forms."""
    one_line(value, "a quantity")
    if not _QUANTITY.match(value):
        raise GrammarError("it is not a quantity envbuild writes (a whole number with an optional Ki, Mi, Gi, Ti or "
                           "Pi suffix, e.g. 64Gi)")
    return value


_IFNAME = re.compile(r"^\^?=?[A-Za-z0-9_.:-]{1,15}\Z")


def socket_ifname(value: str) -> str:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: interface names or prefixes, comma-separated, each
    optionally ``^`` (exclude) and ``=`` (exact match) first (NCCL's env docs); a name is at most
    15 characters (linux/if.h IFNAMSIZ 16 with its NUL) of letters, digits and ``_.:-``.

    >>> socket_ifname("eth0"), socket_ifname("^docker,lo")
    ('eth0', '^docker,lo')
    """
    one_line(value, "an interface list")
    if not all(_IFNAME.match(part) for part in value.split(",")):
        raise GrammarError("it is not a list of network interfaces (names or prefixes of at most 15 letters, digits "
                           "and _.:-, comma-separated, each optionally led by ^ or =)")
    return value


# ---------------------------------------------------------------- NCCL releases

NCCL_VERSION = re.compile(r"^(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})(\.post[1-9][0-9]{0,2})?\Z")


def nccl_version(value: str) -> str:
    """An NCCL release as its nvidia-nccl-cuXX wheel numbers it: MAJOR.MINOR.PATCH in digits, and
    .postN for NVIDIA's re-uploads (2.26.2.post1): what a tag suffix, a requirement line and a
    shell word can all hold unquoted.

    >>> nccl_version("2.31.2")
    '2.31.2'
    >>> nccl_version("2.31")
    Traceback (most recent call last):
    ...
    envbuild.base.grammar.GrammarError: an NCCL release is MAJOR.MINOR.PATCH in digits (and .postN for a re-upload), as its nvidia-nccl-cuXX wheel is numbered (2.31.2)
    """
    if not NCCL_VERSION.match(value):
        raise GrammarError("an NCCL release is MAJOR.MINOR.PATCH in digits (and .postN for a re-upload), as its "
                           "nvidia-nccl-cuXX wheel is numbered (2.31.2)")
    return value


# ---------------------------------------------------------------- secrets

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@'\" \t\r\n]*@")
_QUERY_SECRET = re.compile(r"(?i)([?&](?:access_token|token|password|passwd|secret|sig|signature|key|api_key)=)[^&\s'\"#]*")


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by ``***``: the user-info part
    (``https://user:token@host``) and secret-looking query parameters (``?token=...``). Every
    message, log line, report and record that may quote a URL passes through here.

    >>> redact("push to https://ci:s3cret@registry.example.com/v2/?token=abc failed")
    'push to https://***@registry.example.com/v2/?token=*** failed'
    """
    return _QUERY_SECRET.sub(r"\1***", _USERINFO.sub(r"\1***@", text))
