"""Weight quantization: quantized linear layers, their per-device kernels, and the checkpoint
formats that fill them (design: docs/quantization.md)."""
