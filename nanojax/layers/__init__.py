"""Model building blocks: rotary embedding, attention backends, the Flax ops of a layer."""
