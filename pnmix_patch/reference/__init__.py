"""The pure-PyTorch reference math of PN-Mix: quantization and bit packing (:mod:`.quantize`),
pair selection (:mod:`.selection`) and attention over the packed cache (:mod:`.attention`).

It is the CPU path of every op and the specification the GPU kernels are tested against; it imports
nothing from the package but :mod:`pnmix_patch.config`.
"""
