"""KV tiers below the engine's device cache: host memory (G2) and a shared Redis (G3).

A block is named by the engine's hash chain and stored under
``qos:kv2:<model_fp>:<layout_fp>:[m<mac id>:]<block_hash>``; :class:`~kvstore.tiers.KVTiers` is what an
engine is given (``LLMEngine(args, kv_tier=KVTiers(redis_config, host_capacity_bytes))``).
"""

from kvstore.codec import CorruptBlock
from kvstore.identity import KVIdentity, KVLayout
from kvstore.metrics import TierStats
from kvstore.tiers import KVTiers

__all__ = ["CorruptBlock", "KVIdentity", "KVLayout", "KVTiers", "TierStats"]
