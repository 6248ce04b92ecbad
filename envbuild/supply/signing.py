"""How a publish job signs: the provenance with a key (a DSSE envelope, here and in labs) or
keyless through cosign (Sigstore: the CI job's OIDC identity, Fulcio and Rekor), and whose
signature makes an earlier publish of the same files count as this job's. envbuild never
publishes unsigned images: `publish --job` needs one way to sign, `publish --manifest` signs the
manifest list only keyless (each digest's provenance is signed already)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from securesystemslib.signer import CryptoSigner

from envbuild.base.errors import EnvbuildError
from envbuild.supply import provenance
from envbuild.supply.verify import Trust, trust_from


@dataclass(frozen=True)
class Signing:
    """How provenance is signed: with a key (DSSE, here and in labs), or keyless by cosign in CI."""

    signer: Optional[CryptoSigner] = None
    keyless: bool = False


def signing_from(signing_key: Optional[str], keyless: bool, required: bool = True) -> Signing:
    """--signing-key / --keyless: exactly one where something is signed (envbuild never publishes
    unsigned images); the manifest job with a key signs nothing (each digest's provenance is signed)."""
    if signing_key and keyless:
        raise EnvbuildError("--signing-key and --keyless are two ways to sign; give one (CI: --keyless, with cosign "
                            "and the job's OIDC token; elsewhere: --signing-key).")
    if not signing_key and not keyless:
        if not required:
            return Signing()
        raise EnvbuildError("nothing would sign the provenance: give --signing-key FILE (a PEM private key: openssl "
                            "genpkey -algorithm ed25519 -out envbuild.key) or, in GitHub Actions with cosign, "
                            "--keyless. envbuild does not publish unsigned images.")
    return Signing(signer=provenance.load_signer(signing_key) if signing_key else None, keyless=keyless)


def publish_trust(signing: "Signing") -> Optional[Trust]:
    """Whose signature makes an earlier publish count as this job's: the public half of its key,
    or keyless in GitHub Actions this workflow's identity; None where neither can be named."""
    try:
        return trust_from(None, None, None, signing.signer.public_key if signing.signer else None, signing.keyless)
    except EnvbuildError:
        return None


def cosign(*args: str) -> None:
    """Run cosign (CI: installed by sigstore/cosign-installer; keyless through the job's OIDC token)."""
    binary = shutil.which("cosign")
    if not binary:
        raise EnvbuildError("--keyless signs with cosign, which is not installed here; the workflow installs it "
                            "(sigstore/cosign-installer). Sign with --signing-key where there is no Sigstore.",
                            exit_code=2)
    run = subprocess.run([binary, *args], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise EnvbuildError(f"cosign {args[0]} failed: {run.stderr.strip()[-400:]}", exit_code=1)
