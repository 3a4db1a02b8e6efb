"""The ops, one module per family: each registers its torch.ops.fastlayers.* op's Python side
(fake kernel, autocast, checks) and defines its typed function. Users call them through
fastlayers.functional, the one public re-export."""
