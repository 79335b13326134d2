"""kopf's login (``kopf.ConnectionInfo``) as a ``kubernetes_asyncio`` configuration, and a rotating token file.

The operator and kopf log in the same way (kopf's service-account and kubeconfig logins), so both act under one
identity. Every field of ``ConnectionInfo`` that the API server can use maps onto the library's ``Configuration``:
server, CA, client certificate and key, ``insecure``, proxy, and the ``Authorization`` header (bearer token, another
scheme, or basic auth). The library's TLS setup reads certificates from files only, so in-memory data (a kubeconfig's
``*-data`` fields) is written to a private temporary folder, removed as soon as the client has loaded it.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import kopf
from kubernetes_asyncio.client import Configuration

# Where the kubelet mounts the (projected, rotated) service account token; kopf's in-cluster login reads it too.
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
_AUTH_KEY = "BearerToken"  # the only auth setting the generated client knows; it carries any Authorization value


class TokenFile:
    """A bearer token in a file that someone else rewrites (the kubelet rotates projected service account tokens).

    client-go re-reads such a file once a minute; here the file is checked on every request (one ``stat``), so a
    rotated token is used from the next request on, and ``invalidate`` forces a re-read after a 401.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: Optional[tuple[int, int, int]] = None
        self._token = ""

    def current(self) -> str:
        """The token as the file holds it now."""
        # stat follows the kubelet's ..data symlink swap, so a rotation changes the inode and mtime seen here.
        try:
            info = os.stat(self.path)
        except OSError:
            if self._token:  # gone for a moment (a swap, a remount): the last token may still be good
                return self._token
            raise
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        if stamp != self._stamp:
            with open(self.path, encoding="utf-8") as f:
                self._token = f.read().strip()
            self._stamp = stamp
        return self._token

    def invalidate(self) -> None:
        """Read the file again on the next request (the API server refused the token we sent)."""
        self._stamp = None


def _pem(data: str | bytes) -> bytes:
    """kubeconfig ``*-data`` fields are base64 of PEM; kopf also passes PEM through as is."""
    raw = data.encode("ascii") if isinstance(data, str) else data
    return raw if raw.startswith(b"-----BEGIN ") else base64.b64decode(raw)


@dataclass
class KubeConfig:
    """A library configuration plus what it needs cleaned up; ``token_file``: where a rotating token lives."""

    configuration: Configuration
    token_file: Optional[TokenFile] = None
    _folder: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_connection_info(cls, info: kopf.ConnectionInfo, token_file: Optional[str] = None) -> KubeConfig:
        """Map kopf's credentials onto a ``Configuration``; ``token_file`` overrides ``info.token`` (re-read)."""
        config = Configuration(host=info.server.rstrip("/"))
        out = cls(config, TokenFile(token_file) if token_file else None)
        config.ssl_ca_cert = out._file(info.ca_path, info.ca_data, "ca.crt")
        config.cert_file = out._file(info.certificate_path, info.certificate_data, "client.crt")
        config.key_file = out._file(info.private_key_path, info.private_key_data, "client.key")
        config.verify_ssl = not info.insecure
        config.proxy = info.proxy_url
        header = info.as_http_headers().get("Authorization")
        if out.token_file is not None:
            token = out.token_file
            config.api_key[_AUTH_KEY] = f"Bearer {token.current()}"
            # The library calls this hook before it builds each request's headers (its own in-cluster loader
            # refreshes the same way), so a rotated token goes out with the next request.
            config.refresh_api_key_hook = lambda c: c.api_key.__setitem__(_AUTH_KEY, f"Bearer {token.current()}")
        elif header:
            config.api_key[_AUTH_KEY] = header
        return out

    @property
    def auth_settings(self) -> list[str]:
        """The ``auth_settings`` to pass to ``call_api`` (none when there are no credentials)."""
        return [_AUTH_KEY] if _AUTH_KEY in self.configuration.api_key else []

    def _file(self, path: object, data: Optional[str | bytes], name: str) -> Optional[str]:
        if path:
            return os.fsdecode(path)  # type: ignore[arg-type]
        if not data:
            return None
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="pagoda-kube-")  # mode 0700: the key stays private
        target = os.path.join(self._folder, name)
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(_pem(data))
        return target

    def remove_files(self) -> None:
        """Remove the temporary certificate files (call it once the library's SSL context has loaded them)."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
