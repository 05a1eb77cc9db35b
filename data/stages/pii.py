"""PII scrubbing: e-mail addresses, IP addresses (public ones by default), phone numbers
and common secrets are replaced by fixed placeholders and counted per kind. Placeholders
are stable so a model sees one token pattern per kind, never a half-masked value."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from lathe.core.errors import ConfigError
from lathe.data.document import Document, Verdict, keep
from lathe.data.stages.base import AppliesTo, Stage, StageConfig

PLACEHOLDERS = {
    "private_key": "<PRIVATE_KEY>",
    "secret": "<SECRET>",
    "email": "<EMAIL>",
    "ip": "<IP_ADDRESS>",
    "phone": "<PHONE>",
}

_PRIVATE_KEY = re.compile(
    r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----.*?-----END \1PRIVATE KEY-----", re.DOTALL)
_SECRET = re.compile("|".join([
    r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA)[0-9A-Z]{16}\b",  # AWS access key ids
    r"\bAIza[0-9A-Za-z_\-]{35}\b",  # Google API keys
    r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b",  # GitHub tokens
    r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b",
    r"\bxox[abposr]-[A-Za-z0-9-]{10,250}\b",  # Slack tokens
    r"\bsk-(?:proj-)?[A-Za-z0-9_-]{32,}\b",  # OpenAI-style API keys
]))
_EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+"
    r"[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
_IPV6 = re.compile(r"(?<![0-9A-Fa-f:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}"
                   r"(?:(?<=:)(?:\d{1,3}\.){3}\d{1,3})?(?![0-9A-Fa-f:])")
# NANP and international numbers written with separators; bare digit runs are left alone
# because in code and tables they are far more often ids and constants than phones.
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w-])")

_PATTERNS = {"private_key": _PRIVATE_KEY, "secret": _SECRET, "email": _EMAIL, "phone": _PHONE}


@dataclass
class PIIConfig(StageConfig):
    applies_to: AppliesTo = "all"
    kinds: list[str] = field(default_factory=lambda: list(PLACEHOLDERS))
    only_public_ips: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(PLACEHOLDERS)
        if unknown:
            raise ConfigError(f"pii.kinds has unknown kinds {sorted(unknown)}; "
                              f"choose from {list(PLACEHOLDERS)}")


class PII(Stage):
    name = "pii"
    config: PIIConfig

    def _is_scrubbed_ip(self, candidate: str) -> bool:
        try:
            address = ipaddress.ip_address(candidate)
        except ValueError:
            return False
        return address.is_global or not self.config.only_public_ips

    def __call__(self, doc: Document) -> Verdict:
        counts: dict[str, int] = {}
        text = doc.text
        for kind in PLACEHOLDERS:  # secrets before e-mails/IPs that may sit inside them
            if kind not in self.config.kinds:
                continue
            if kind == "ip":
                n = 0

                def scrub_ip(match: re.Match) -> str:
                    nonlocal n
                    if self._is_scrubbed_ip(match.group(0)):
                        n += 1
                        return PLACEHOLDERS["ip"]
                    return match.group(0)

                text = _IPV4.sub(scrub_ip, text)
                text = _IPV6.sub(scrub_ip, text)
            else:
                text, n = _PATTERNS[kind].subn(PLACEHOLDERS[kind], text)
            counts[kind] = n
        doc.text = text
        return keep(**counts)
