"""Strict JSON schemas for the cert-manager objects k8s/components/cert-manager renders (cert-manager.io/v1
Issuer and Certificate), which kubernetes-validate's bundled Kubernetes schemas do not cover.

Written from cert-manager's v1 CRDs (deploy/crds in cert-manager/cert-manager): every spec field a
Certificate may carry, with the types, the enums (key usages, key algorithms, encodings, rotation policy)
and the required fields; an Issuer's selfSigned and ca kinds in full, the other kinds as objects. Unknown
fields fail, as they do for the built-in kinds under kubernetes-validate's strict mode."""

from __future__ import annotations

from typing import Any

import jsonschema

KEY_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
    "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
    "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]  # fmt: skip

_STRINGS = {"type": "array", "items": {"type": "string"}}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "additionalProperties": False,
}
_SECRET_KEY_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
    "additionalProperties": False,
}
_KEYSTORE = {
    "type": "object",
    "required": ["create"],
    "properties": {
        "create": {"type": "boolean"},
        "passwordSecretRef": _SECRET_KEY_REF,
        "password": {"type": "string"},
        "profile": {"type": "string"},
        "alias": {"type": "string"},
    },
    "additionalProperties": False,
}


def _object(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


CERTIFICATE = _object(
    "Certificate",
    {
        "type": "object",
        "required": ["secretName", "issuerRef"],
        "properties": {
            "secretName": {"type": "string", "minLength": 1},
            "issuerRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                    "group": {"type": "string"},
                },
                "additionalProperties": False,
            },
            "commonName": {"type": "string", "maxLength": 64},
            "dnsNames": _STRINGS,
            "ipAddresses": _STRINGS,
            "uris": _STRINGS,
            "emailAddresses": _STRINGS,
            "duration": {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"},
            "renewBefore": {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"},
            "renewBeforePercentage": {"type": "integer"},
            "isCA": {"type": "boolean"},
            "usages": {"type": "array", "items": {"enum": KEY_USAGES}},
            "privateKey": {
                "type": "object",
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                },
                "additionalProperties": False,
            },
            "subject": {
                "type": "object",
                "properties": {
                    k: _STRINGS
                    for k in (
                        "countries",
                        "localities",
                        "organizationalUnits",
                        "organizations",
                        "postalCodes",
                        "provinces",
                        "streetAddresses",
                    )
                }
                | {"serialNumber": {"type": "string"}},
                "additionalProperties": False,
            },
            "literalSubject": {"type": "string"},
            "secretTemplate": {
                "type": "object",
                "properties": {"labels": _LABELS, "annotations": _LABELS},
                "additionalProperties": False,
            },
            "keystores": {
                "type": "object",
                "properties": {"jks": _KEYSTORE, "pkcs12": _KEYSTORE},
                "additionalProperties": False,
            },
            "additionalOutputFormats": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["DER", "CombinedPEM"]}},
                    "additionalProperties": False,
                },
            },
            "encodeUsagesInRequest": {"type": "boolean"},
            "revisionHistoryLimit": {"type": "integer", "minimum": 1},
            "signatureAlgorithm": {"type": "string"},
            "nameConstraints": {"type": "object"},
            "otherNames": {"type": "array", "items": {"type": "object"}},
        },
        "additionalProperties": False,
    },
)

ISSUER = _object(
    "Issuer",
    {
        "type": "object",
        "properties": {
            "selfSigned": {
                "type": "object",
                "properties": {"crlDistributionPoints": _STRINGS},
                "additionalProperties": False,
            },
            "ca": {
                "type": "object",
                "required": ["secretName"],
                "properties": {
                    "secretName": {"type": "string", "minLength": 1},
                    "crlDistributionPoints": _STRINGS,
                    "ocspServers": _STRINGS,
                    "issuingCertificateURLs": _STRINGS,
                },
                "additionalProperties": False,
            },
            "acme": {"type": "object"},
            "vault": {"type": "object"},
            "venafi": {"type": "object"},
        },
        "minProperties": 1,
        "maxProperties": 1,  # one kind of issuer
        "additionalProperties": False,
    },
)

SCHEMAS = {"Certificate": CERTIFICATE, "Issuer": ISSUER}


def is_cert_manager(obj: dict[str, Any]) -> bool:
    return obj.get("apiVersion", "").startswith("cert-manager.io/")


def validate(obj: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError for an object cert-manager's v1 CRDs would refuse (or a kind
    not checked here)."""
    schema = SCHEMAS.get(obj.get("kind", ""))
    if schema is None:
        raise jsonschema.ValidationError(f"no schema here for {obj.get('apiVersion')} {obj.get('kind')}")
    jsonschema.validate(obj, schema)
