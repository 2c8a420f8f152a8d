"""Conversations: a conversation's KV kept across turns in bounded tiers, passages fused in each turn.

`kvrag.chat.messages` cuts a conversation into per-message token ids; `kvrag.chat.history` extends and
truncates its kept KV; `kvrag.chat.tiers` holds it on GPU, host and disk; `kvrag.chat.sessions` finds it
by token prefix and keeps it after each turn; `kvrag.chat.turn` runs one turn. Users call
`KVRag.chat` and `KVRag.chat_stream`.
"""

from kvrag.chat.history import HistoryKV
from kvrag.chat.sessions import ChatSessions, HistoryReport

__all__ = ["ChatSessions", "HistoryKV", "HistoryReport"]
