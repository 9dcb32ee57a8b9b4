"""Out-of-cluster login against a mutual-TLS API server on loopback, made here with the openssl CLI.

The kubeconfig carries the CA, the client certificate and the key as base64 `*-data`, as `kind`,
`minikube` and most cloud CLIs write them. The server requires a client certificate signed by the CA and
answers with the certificate's common name and the Authorization header it got.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import kopf
import pytest
import yaml
from aiohttp import web

from decodeservice.operator.errors import ApiError
from decodeservice.operator.kube import KINDS, KubeClient, load_cert_chain_from_memory, pem
from tests.support.loopback_http import serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")

USER_CN = "decodeservice-test-user"
TOKEN = "t0ken-from-kubeconfig"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ec_key_and_csr(cwd: Path, name: str, cn: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd)


@dataclass
class Pki:
    folder: Path

    def read(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.crt", "-subj", "/CN=test-ca", "-days", "2", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, cn in (("server", "127.0.0.1"), ("client", USER_CN)):
        _ec_key_and_csr(d, name, cn)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return Pki(folder=d)


@pytest.fixture
async def api_server(pki: Pki) -> AsyncIterator[str]:
    async def configmap(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(x[0] for x in (peer or {}).get("subject", ()))
        return web.json_response({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"},
                                  "data": {"client": subject.get("commonName", ""),
                                           "auth": request.headers.get("Authorization", "")}})

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.folder / "ca.crt"))
    ctx.verify_mode = ssl.CERT_REQUIRED  # no client certificate, no handshake
    ctx.load_cert_chain(str(pki.folder / "server.crt"), str(pki.folder / "server.key"))
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/default/configmaps/probe", configmap)
    async with serve(app, ssl_context=ctx) as url:
        yield url


def write_kubeconfig(path: Path, pki: Pki, server: str) -> Path:
    b64 = {name: base64.b64encode(pki.read(name)).decode() for name in ("ca.crt", "client.crt", "client.key")}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority-data": b64["ca.crt"]}}],
        "users": [{"name": "u", "user": {"client-certificate-data": b64["client.crt"],
                                         "client-key-data": b64["client.key"], "token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u", "namespace": "default"}}]}))
    return path


async def probe(info: kopf.ConnectionInfo) -> dict[str, str]:
    client = KubeClient(info, timeout_seconds=10)
    try:
        got = await client.get(KINDS["ConfigMap"], "default", "probe")
    finally:
        await client.close()
    assert got is not None
    return dict(got["data"])


async def test_kopf_kubeconfig_login_with_base64_data_fields(api_server: str, pki: Pki, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", pki, api_server)))
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    assert info is not None and isinstance(info.private_key_data, str)
    assert not info.private_key_data.startswith("-----BEGIN")  # kopf hands the kubeconfig's base64 on as is
    assert pem(info.private_key_data) == pki.read("client.key")
    assert await probe(info) == {"client": USER_CN, "auth": f"Bearer {TOKEN}"}


async def test_without_a_client_certificate_the_server_refuses(api_server: str, pki: Pki) -> None:
    info = kopf.ConnectionInfo(server=api_server, ca_data=pki.read("ca.crt"), token=TOKEN)
    with pytest.raises(ApiError) as err:
        await probe(info)
    assert err.value.status == 0  # the TLS handshake failed: no API answer at all


async def test_a_server_outside_the_ca_is_refused(api_server: str, pki: Pki) -> None:
    # The client's own certificate is no CA of the server's: verification must fail, not pass silently.
    info = kopf.ConnectionInfo(server=api_server, ca_data=pki.read("client.crt"),
                               certificate_data=pki.read("client.crt"), private_key_data=pki.read("client.key"))
    with pytest.raises(ApiError) as err:
        await probe(info)
    assert "CERTIFICATE_VERIFY_FAILED" in err.value.message


# Run in a fresh interpreter: the official client reads $KUBECONFIG once, when it is imported.
LOGIN_SCRIPT = """
import asyncio, json, logging, os, sys
import kopf
from decodeservice.operator.kube import KINDS, KubeClient, login

async def probe(info):
    client = KubeClient(info, timeout_seconds=10)
    try:
        return (await client.get(KINDS["ConfigMap"], "default", "probe"))["data"]
    finally:
        await client.close()

settings, logger = kopf.OperatorSettings(), logging.getLogger("login")
chain = login(settings=settings, logger=logger)
first = asyncio.run(probe(chain))
tmp = os.environ["TMPDIR"]
before = sorted(os.listdir(tmp))
direct = kopf.login_with_kubeconfig(settings=settings)
second = asyncio.run(probe(direct))
print(json.dumps({"via_client_paths": bool(chain.ca_path and chain.certificate_path and chain.private_key_path),
                  "first": first, "second": second, "before": before, "after": sorted(os.listdir(tmp))}))
"""


async def test_login_chain_uses_the_official_client_and_our_tls_leaves_no_files(api_server: str, pki: Pki,
                                                                                tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(write_kubeconfig(tmp_path / "kubeconfig", pki, api_server)), TMPDIR=str(tmp),
               HOME=str(tmp_path))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-P", "-c", LOGIN_SCRIPT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out.decode().strip().splitlines()[-1])
    # The official client logged in first (kopf passes its files on as paths), with the kubeconfig's token.
    assert result["via_client_paths"]
    assert result["first"] == {"client": USER_CN, "auth": f"Bearer {TOKEN}"}
    # kopf's own reader keeps the base64 data in memory; our TLS context wrote no file for it.
    assert result["second"] == result["first"]
    assert result["after"] == result["before"]


@pytest.mark.parametrize("use_memfd", [True, False], ids=["memfd", "private-tempdir"])
async def test_both_ways_of_loading_a_key_from_memory(api_server: str, pki: Pki, use_memfd: bool) -> None:
    if use_memfd and not hasattr(os, "memfd_create"):
        pytest.skip("os.memfd_create is Linux-only")
    ours = {p.name for p in Path(tempfile.gettempdir()).glob("decodeservice-tls-*")}
    ctx = ssl.create_default_context(cadata=pki.read("ca.crt").decode())
    load_cert_chain_from_memory(ctx, pki.read("client.crt") + pki.read("client.key"), use_memfd=use_memfd)
    assert {p.name for p in Path(tempfile.gettempdir()).glob("decodeservice-tls-*")} == ours  # nothing left
    async with aiohttp.ClientSession() as session, session.get(
            f"{api_server}/api/v1/namespaces/default/configmaps/probe", ssl=ctx) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"]["client"] == USER_CN
