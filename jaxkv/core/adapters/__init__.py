"""LoRA adapters on the host: known adapters, host copies, device slots (`lora`)."""
