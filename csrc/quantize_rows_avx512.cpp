// quantize_rows.cpp with AVX-512 (setup.py: the AVX-512 unit's flags and -ffp-contract=off): the
// same row quantizers, symmetric int4 two groups a pass. Chosen by quantize.cpp where the CPU has
// them and the engine's ISA is not forced to avx2.
#define HETMOE_QUANT_AVX512 1
#include "quantize_rows.cpp"
