"""HF safetensors export, and resumable training checkpoints (torch.distributed.checkpoint)."""

from .checkpoint_export import export_checkpoint
from .checkpoints import CheckpointError, find_checkpoint, list_checkpoints, load_checkpoint
from .hf_export import export_dtype, export_hf_model, gather_full_state_dict, on_disk_state
from .saving import CheckpointWriter, save_checkpoint

__all__ = ["CheckpointError", "CheckpointWriter", "export_checkpoint", "export_dtype", "export_hf_model", "find_checkpoint",
           "gather_full_state_dict", "list_checkpoints", "load_checkpoint", "on_disk_state", "save_checkpoint"]
