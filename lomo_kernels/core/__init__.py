"""The floor every other part stands on, torch alone beneath it: argument checks, device
scalars, the op-spec machinery, the write-back's rounding, and the gradient-sink protocol
through which an op hands a weight's gradient to whoever steps that weight."""
