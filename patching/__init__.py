"""fastlayers.patching: swapping fused layers into a live model in place (the patcher arrives
with a later release; for now the fused layers are constructed directly or via
``Layer.from_native``)."""
