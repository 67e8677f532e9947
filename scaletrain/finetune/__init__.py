"""Fine-tuning: full, frozen layers, LoRA and QLoRA; SFT and sequence classification."""
