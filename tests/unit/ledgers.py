"""Page keys for the page ledger tests."""

from __future__ import annotations

from memory_daemon.prefix import page_keys

KEYS = page_keys(list(range(64)), page_size=16)  # four chained keys
