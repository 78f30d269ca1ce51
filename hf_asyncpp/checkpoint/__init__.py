"""Model export (HF safetensors) and, later, resumable training state."""

from .hf_export import export_hf_model, gather_full_state_dict

__all__ = ["export_hf_model", "gather_full_state_dict"]
