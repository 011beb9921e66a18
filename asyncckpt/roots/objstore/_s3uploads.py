"""Incomplete multipart uploads on S3: list and abort them (obstore has no API for either).

A cancelled or crashed multipart upload stays on the store (billed, invisible to LIST)
until it is aborted. These two calls are the housekeeping the object-store backend needs;
they are plain SigV4-signed HTTP requests (AWS Signature Version 4, written from the AWS
documentation), run blocking on a worker thread. Only static credentials (storage options
or the ``AWS_*`` environment variables) are supported; without them the backend reports
that it cannot clean up and relies on the bucket's ``AbortIncompleteMultipartUpload``
lifecycle rule.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import http.client
import ssl
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class Upload:
    """One incomplete multipart upload."""

    key: str
    upload_id: str
    initiated: str


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str
    token: str | None = None

    def __repr__(self) -> str:  # never show the secret
        return "S3Credentials(<redacted>)"


class UploadsError(OSError):
    """A list/abort request failed (status and the S3 error code in the message)."""


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _q(s: str, safe: str = "-_.~") -> str:
    return quote(s, safe=safe)


class UploadsClient:
    """Signed ListMultipartUploads / AbortMultipartUpload against one bucket."""

    def __init__(
        self, bucket: str, region: str, credentials: S3Credentials, endpoint: str | None = None, timeout: float = 30.0
    ) -> None:
        self.bucket = bucket
        self.region = region
        self._creds = credentials
        self.timeout = timeout
        if endpoint:
            parts = urlsplit(endpoint)
            self._https = parts.scheme == "https"
            self._host = parts.netloc
            self._base = parts.path.rstrip("/") + "/" + _q(bucket)
        else:
            self._https = True
            self._host = f"{bucket}.s3.{region}.amazonaws.com"
            self._base = ""

    def __repr__(self) -> str:
        return f"UploadsClient(bucket={self.bucket!r}, host={self._host!r})"

    def _request(self, method: str, path: str, query: dict[str, str]) -> tuple[int, bytes]:
        now = _dt.datetime.now(_dt.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        day = now.strftime("%Y%m%d")
        canonical_query = "&".join(f"{_q(k)}={_q(v)}" for k, v in sorted(query.items()))
        headers = {"host": self._host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz_date}
        if self._creds.token:
            headers["x-amz-security-token"] = self._creds.token
        signed = ";".join(sorted(headers))
        canonical = "\n".join(
            [
                method,
                path,
                canonical_query,
                "".join(f"{k}:{headers[k].strip()}\n" for k in sorted(headers)),
                signed,
                _EMPTY_SHA256,
            ]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = _hmac(_hmac(_hmac(_hmac(("AWS4" + self._creds.secret_access_key).encode(), day), self.region), "s3"),
                    "aws4_request")
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self._creds.access_key_id}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(self._host, timeout=self.timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self._host, timeout=self.timeout)
        try:
            conn.request(method, path + ("?" + canonical_query if canonical_query else ""), headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _object_path(self, key: str) -> str:
        return f"{self._base}/{_q(key, safe='-_.~/')}"

    def list_uploads(self, prefix: str) -> list[Upload]:
        """Every incomplete upload whose key starts with ``prefix`` (all pages)."""
        out: list[Upload] = []
        query = {"uploads": "", "prefix": prefix}
        for _ in range(10_000):  # bounded: 10,000 pages of 1,000
            status, body = self._request("GET", self._base + "/", query)
            if status != 200:
                raise UploadsError(f"ListMultipartUploads failed: HTTP {status} {_code(body)}")
            root = ET.fromstring(body)
            for up in root.iter(f"{_NS}Upload"):
                out.append(
                    Upload(up.findtext(f"{_NS}Key", ""), up.findtext(f"{_NS}UploadId", ""),
                           up.findtext(f"{_NS}Initiated", ""))
                )
            if root.findtext(f"{_NS}IsTruncated", "false").lower() != "true":
                break
            query = dict(query, **{"key-marker": root.findtext(f"{_NS}NextKeyMarker", ""),
                                   "upload-id-marker": root.findtext(f"{_NS}NextUploadIdMarker", "")})
        return out

    def abort(self, key: str, upload_id: str) -> None:
        """Abort one upload; an upload that is already gone counts as aborted."""
        status, body = self._request("DELETE", self._object_path(key), {"uploadId": upload_id})
        if status not in (200, 204, 404):
            raise UploadsError(f"AbortMultipartUpload failed: HTTP {status} {_code(body)}")


def _code(body: bytes) -> str:
    """The S3 error code of an error body (never the whole body: it may echo request data)."""
    try:
        return ET.fromstring(body).findtext("Code", "") or ""
    except ET.ParseError:
        return ""
