"""HF safetensors export, and resumable training checkpoints (torch.distributed.checkpoint)."""

from .checkpoint_export import export_checkpoint
from .checkpoints import CheckpointError, find_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from .hf_export import export_dtype, export_hf_model, gather_full_state_dict, on_disk_state

__all__ = ["CheckpointError", "export_checkpoint", "export_dtype", "export_hf_model", "find_checkpoint",
           "gather_full_state_dict", "list_checkpoints", "load_checkpoint", "on_disk_state", "save_checkpoint"]
