"""What a user hands a render or a build beside the request's choices, read and checked before
anything resolves: `--env NAME=VALUE` pairs, and the files `--apt-key` and `--ca-cert` name (the
build's secrets: a key that is no OpenPGP key, a bundle OpenSSL cannot read, is refused here, not
by apt or pip minutes into the build).
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Optional

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes


def parse_env_pairs(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for p in pairs:
        if "=" not in p:
            raise EnvbuildError(f"--env '{p}' must be NAME=VALUE, e.g. --env NCCL_P2P_DISABLE=0.")
        name, value = p.split("=", 1)
        out.append((name, value))
    return tuple(out)


def apt_key_file(path: Optional[str]) -> Optional[Path]:
    """Validate --apt-key: an OpenPGP public key (armored, or apt's binary keyring)."""
    if not path:
        return None
    p = Path(path)
    data = read_bytes(p, "--apt-key", "ca")
    armored = b"-----BEGIN PGP PUBLIC KEY BLOCK-----" in data[:4096]
    # A binary keyring starts with a public-key packet: tag 6, old format (0x98/0x99) or new (0xc6).
    if not armored and (not data or data[0] not in (0x98, 0x99, 0xC6)):
        raise EnvbuildError(f"--apt-key {path} is not an OpenPGP public key (neither a '-----BEGIN PGP PUBLIC KEY "
                            f"BLOCK-----' file nor a binary keyring): give the key that signs the mirror's Release "
                            f"files, e.g. from `gpg --export --armor KEYID > key.asc`.")
    return p


def ca_file(path: Optional[str]) -> Optional[Path]:
    """Validate --ca-cert: a readable PEM file."""
    if not path:
        return None
    p = Path(path)
    text = read_bytes(p, "--ca-cert", "ca").decode("ascii", errors="replace")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise EnvbuildError(f"--ca-cert {path} holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' line); give "
                            f"the CA's certificate in PEM, such as /etc/ssl/certs/ca-certificates.crt.")
    try:  # OpenSSL reads every certificate of the bundle, as pip, uv and apt inside the build will
        count = _certificates(text)
    except ssl.SSLError as e:
        why = e.reason or str(e).split(" (_ssl")[0]
        raise EnvbuildError(f"--ca-cert {path} is not a PEM certificate bundle OpenSSL can read ({why}): a "
                            f"block between its BEGIN and END lines is not a certificate; give the CA's certificate "
                            f"as its issuer exported it (`openssl x509 -in CA.crt -text` prints it), such as "
                            f"/etc/ssl/certs/ca-certificates.crt.") from None
    if count == 0:
        raise EnvbuildError(f"--ca-cert {path} holds no certificate OpenSSL can read; give the CA's certificate in "
                            f"PEM, such as /etc/ssl/certs/ca-certificates.crt.")
    return p


def _certificates(pem: str) -> int:
    """How many certificates OpenSSL reads from `pem` (ssl.SSLError: a block that is not one)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    blocks = re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", pem, re.S)
    if not blocks:
        return 0
    context.load_verify_locations(cadata="\n".join(blocks))
    return context.cert_store_stats()["x509"]
