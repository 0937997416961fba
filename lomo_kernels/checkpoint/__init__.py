"""Checkpoints that resume where a run stopped, sharded or not.

`save_checkpoint` / `load_checkpoint` write and read the model and optimizer through
torch.distributed.checkpoint, each rank its own shards (no gather to one rank), and refuse
an incomplete, corrupt or mismatched checkpoint before anything changes; reading one runs no
code it holds (`safe_loading`; ``trust_checkpoint=True`` for a checkpoint the caller
trusts). The optimizers' own ``state_dict()`` also works with torch's ``get_state_dict`` /
``set_state_dict``. A DeepSpeed engine trained by Lomo/AdaLomo gets
``engine.save_checkpoint`` / ``load_checkpoint`` that do the same
(`serve_engine_checkpoints`).
"""

from .deepspeed_engine import restore_engine_checkpoints, serve_engine_checkpoints
from .manifest import MANIFEST, CheckpointError
from .sharded import load_checkpoint, save_checkpoint, verify_checkpoint

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "load_checkpoint",
    "restore_engine_checkpoints",
    "save_checkpoint",
    "serve_engine_checkpoints",
    "verify_checkpoint",
]
