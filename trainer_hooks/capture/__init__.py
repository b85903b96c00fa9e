"""What captures the trainer's state: the model as laid out in the flat space (FSDP2 shards
included), its RNG and the state outside the optimizer."""
