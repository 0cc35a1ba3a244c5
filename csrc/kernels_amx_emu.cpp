// The AMX unit with its tile operations emulated (amx_tiles.h), compiled with the AVX-512 flags only
// (setup.py): the packing and the loops of kernels_amx.cpp run and are tested on any CPU with
// AVX-512, bit for bit against the hardware where it has AMX (tests/test_amx.py). The variant is
// "amx-emu"; "auto" never selects it.
#define HETMOE_AMX_EMULATED 1
#include "kernels_amx.cpp"
