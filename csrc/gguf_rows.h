// Rows of a table in GGUF blocks decoded to fp32 (an embedding lookup), bit for bit as
// hetmoe/formats/gguf's decoders (and ggml's dequantize_row_*) give them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hetmoe {

// The ggml types gguf_rows decodes, lower-case ggml names.
std::vector<std::string> gguf_row_kinds();

// out[i, :] = row ids[i] of `table` (rows of `row_bytes` bytes, `k` weights each) decoded, for i < n.
// Returns -1, or the position in `ids` of the first id outside [0, rows) (nothing is written then).
// Throws std::invalid_argument for a type gguf_row_kinds does not list.
int64_t gguf_rows(const std::string& kind, const uint8_t* table, int64_t row_bytes, int64_t rows, const int64_t* ids,
                  int64_t n, int64_t k, float* out);

}  // namespace hetmoe
