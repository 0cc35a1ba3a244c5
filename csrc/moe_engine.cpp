#include "moe_engine.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tile_path.h"

namespace hetmoe {
namespace {

using engine::act_quant_for;
using engine::bf16_dot;
using engine::bf16_rows;
using engine::ActBuffers;
using engine::item_rows;
using engine::sized;
using engine::tile_gemm;
using engine::tile_rows;
using engine::uninit;

// Per-worker scratch for the GEMM path (dequantized panels, their bf16 roundings, the up-projection block).
struct Scratch {
  std::vector<float> panel_a, panel_b, block;
  std::vector<uint16_t> bf16_a, bf16_b;
  std::vector<const float*> rows;  // combine's: a token's expert output rows, and their weights
  std::vector<float> weights;
};
thread_local Scratch tl_scratch;
thread_local engine::GroupTiles tl_own_tiles;  // an item's own packed activations (MoEJob::x_acts, h_acts)

class MoEJob final : public Job {
 public:
  MoEJob(int E, int H, int I, const Proj& gate, const Proj& up, const Proj& down, const ActConfig& act,
         const KernelTable* kt, int gemv_max, const std::vector<NodeRows>& split, const void* x, int x_dtype, int T,
         const int64_t* ids, int topk, const float* weights, void* y, const uint8_t* skip, int threads)
      : H_(H), I_(I), gate_(gate), up_(up), down_(down), act_(act), kt_(kt), gemv_max_(gemv_max), x_(x),
        x_dtype_(x_dtype), T_(T), topk_(topk), weights_(weights), y_(y) {
    route(E, ids, skip);
    // Items of each expert enough for four a thread (of a node) over the phase (a decode step's 8
    // experts on 2 threads: one item an expert; on 32 threads, 16).
    const int nodes = static_cast<int>(split.size());
    const int A = static_cast<int>(active_.size());
    const int per_expert = A == 0 ? 1 : (4 * std::max(1, threads / nodes) + A - 1) / A;
    for (const NodeRows& r : split) {
      up_items_.add(r.up0, r.up1, item_rows(gate, std::max(1, r.up1 - r.up0), per_expert));
      down_items_.add(r.down0, r.down1, item_rows(down, std::max(1, r.down1 - r.down0), per_expert));
    }
    up_items_.repeat(A);
    down_items_.repeat(A);
    if (x_dtype_ == kBF16Data) xf_ = uninit<float>(size_t(T) * H);
    xh_ = engine::bf16_x(kt, x, x_dtype);
    // Where gate and up read the activations as int8 digits on AMX tiles, each token is quantized once
    // in phase 0 and every expert gathers its tokens' digit rows (a token goes to top-k experts, which
    // each quantized it again). The int4 layer at 512 tokens on the AMX Xeon: perf put ~4 ms of 70 in
    // amx_pack_i8, most of it gate and up's; ~1 ms less with the digit rows (docs/benchmarks.md).
    const bool gemm = !active_.empty() && active_[0].count > gemv_max;  // some expert takes the GEMM path
    if (gemm && tile_gemm(kt) && engine::tile_digit_rows(kt, gate, up)) {
      xq_ = uninit<int8_t>(size_t(2) * T * H + 64);
      xq_base_ = engine::align64(xq_.get());
      xq_d_ = uninit<float>(size_t(T));
    }
    // Every expert on the GEMVs: one phase (fuse), where the pool is one group. With several, a thread
    // takes its own group's items first, and two threads of one group (the caller's CPU is wherever
    // the user's thread runs) could both wait in down items for gate/up items of another group's
    // that neither has claimed.
    if (!active_.empty() && !gemm && nodes == 1) fuse(A);
    // Activations in the GEMVs' layouts only where some expert takes a GEMV (active_ is sorted by
    // count, busiest first): a prefill whose experts all take the GEMM path skips their phase-0 and
    // phase-3 quantization.
    const bool any_gemv = !active_.empty() && active_.back().count <= gemv_max;
    const int busiest = active_.empty() ? 0 : active_[0].count;
    const auto gemv_layout = [&](int method, int K) {
      return any_gemv ? act_quant_for(kt, method, K, busiest) : kActNone;
    };
    const bool float_wide = engine::float_gemv_wide(busiest);
    x_act_.allocate(T, H, gemv_layout(gate.method, H), engine::act_one_digit(gate.method), float_wide);
    // Gate and up in methods whose GEMVs read different layouts (a GGUF file may store them in two
    // types) each get their own copy of the activations.
    const int up_mode = gemv_layout(up.method, H);
    if (up_mode != x_act_.mode || engine::act_one_digit(up.method) != x_act_.one_digit)
      xu_act_.allocate(T, H, up_mode, engine::act_one_digit(up.method), float_wide);
    h_ = uninit<float>(size_t(S_) * I);
    h_act_.allocate(S_, I, gemv_layout(down.method, I), engine::act_one_digit(down.method), float_wide);
    // A bf16 model's GEMM-path experts take VDPBF16PS against its bf16 activations: bf16 weights as
    // stored, any other method's rows dequantized and rounded to bf16 (what the model computes with
    // when it dequantizes the checkpoint into its dtype; twice the products an instruction of the
    // fp32 panel's FMAs), the intermediate rounded to bf16 first (as the model's own bf16 MLP rounds
    // it). Only where some expert takes the GEMM path: a decode step skips the bf16 copy and its phase.
    const bool bf16_model = x_dtype_ == kBF16Data && gemm;
    // On AMX tiles a bf16 model's intermediate is rounded to bf16 for a bf16 down projection the same
    // way, so that it is one tile pass; the tiles run the other methods their own way.
    const bool tiles = tile_gemm(kt);
    bf16_up_ = bf16_model && (tiles ? gate.method == kBF16 && up.method == kBF16 : bf16_dot(kt));
    bf16_down_ = bf16_model && (tiles ? down.method == kBF16 : bf16_dot(kt));
    if (bf16_down_ && !tiles) hb_ = uninit<uint16_t>(size_t(S_) * I);  // tiles round as they pack
    ybuf_ = uninit<float>(size_t(S_) * H);
    // The tile-path experts (the busiest, a prefix of active_) get their tokens and their intermediate
    // rows packed once each, in phases 1 and 4 (engine::GroupTiles), where an expert has several items
    // in the phase that reads them; with one, its item packs them (the tiles then stay in the cache of
    // the core that reads them: the int4 layer at 512 tokens, one item an expert, took 66.3-67.6 ms
    // packed in its items against 68.9-69.1 packed in a phase of their own, alternating on the AMX Xeon).
    // Only where some expert takes the tiles: a decode step skips it.
    if (tiles && gemm) {
      x_forms_ = engine::tile_forms(kt, x_dtype_ != kBF16Data, gate, up);
      h_forms_ = engine::tile_forms(kt, !bf16_down_, down, down);
      std::vector<int> counts;
      for (const ActiveExpert& a : active_)
        if (a.count > gemv_max) counts.push_back(a.count);
      if (up_items_.chunks() > 1) x_tiles_.plan(counts, H, x_forms_);
      if (down_items_.chunks() > 1) h_tiles_.plan(counts, I, h_forms_);
    }
  }

  Phase next_phase(int index) override {
    switch (index) {
      case 0:  // activations to fp32 (and int8 for integer kernels, digits for the tiles), one token an item
        return {x_dtype_ == kBF16Data || x_act_.mode != kActNone || xu_act_.mode != kActNone || xq_ ? T_ : 0,
                [this](int t, int) { prepare_token(t); }};
      case 1:  // the tile-path experts' tokens packed, 16 an item
        return {x_tiles_.items(), [this](int i, int) { pack_x_tile(i); }};
      case 2:  // gate and up, then SiLU * up, by (node, expert, block of rows of I); fused: phases 3-6 too
        return fused_ ? fused_phase() : up_items_.phase([this](int i, int) { gate_up(i); });
      case 3:  // the intermediate activations quantized for an integer down projection (or to bf16)
        return {quantize_h() && !fused_ ? S_ : 0, [this](int s, int) { prepare_h(s); }};
      case 4:  // the tile-path experts' intermediate rows packed, 16 an item
        return {h_tiles_.items(), [this](int i, int) { pack_h_tile(i); }};
      case 5:  // down, by (node, expert, block of rows of H)
        if (fused_) return {0, nullptr};
        return down_items_.phase([this](int i, int) { down(i); });
      case 6:  // weighted sum of each token's expert outputs (fused: the tokens no expert took)
        if (fused_) return {int(unrouted_.size()), [this](int i, int) { combine(unrouted_[i]); }};
        return {T_, [this](int t, int) { combine(t); }};
      default:
        return {};
    }
  }

 private:
  struct ActiveExpert {
    int expert, first_slot, count;
  };

  // Slots are (token, k) pairs that run here, sorted by expert so each expert's tokens are
  // contiguous; busiest experts first so the tail of a phase is short.
  void route(int E, const int64_t* ids, const uint8_t* skip) {
    std::vector<int> count(E, 0);
    const int pairs = T_ * topk_;
    for (int p = 0; p < pairs; ++p) {
      const int64_t e = ids[p];
      if (e >= 0 && e < E && !(skip && skip[e])) ++count[e];
    }
    for (int e = 0; e < E; ++e)
      if (count[e]) active_.push_back({e, 0, count[e]});
    std::stable_sort(active_.begin(), active_.end(),
                     [](const ActiveExpert& a, const ActiveExpert& b) { return a.count > b.count; });
    std::vector<int> cursor(E, -1);
    S_ = 0;
    for (auto& a : active_) {
      a.first_slot = S_;
      cursor[a.expert] = S_;
      S_ += a.count;
    }
    slot_token_.assign(S_, 0);
    slot_of_.assign(pairs, -1);
    for (int p = 0; p < pairs; ++p) {
      const int64_t e = ids[p];
      if (e >= 0 && e < E && !(skip && skip[e])) {
        const int s = cursor[e]++;
        slot_token_[s] = p / topk_;
        slot_of_[p] = s;
      }
    }
  }

  // Whether the intermediate rows are prepared for down (quantized to its GEMV's layout, or to bf16).
  bool quantize_h() const { return h_act_.mode != kActNone || hb_; }

  // A job whose experts all take the GEMVs (a decode step) runs gate/up and down in one phase, the
  // gate/up items first, then the down items: an expert's down items start once its own
  // gate/up items are done, not all experts', and the last of its gate/up items prepares its
  // intermediate rows (phase 3's work) and the last of its down items adds the output of each token
  // whose experts are then all done (phase 6's), so no thread waits at a phase's end for a slower
  // one's last item, and three hand-offs go. Items are claimed in order: a down item's gate/up items
  // were claimed before it and never wait, so its wait ends. A Qwen3-30B-A3B layer from DRAM, 2
  // threads of the AMX Xeon, in one process alternating: int4 1-token 0.5-0.8% faster, 2-4 tokens
  // 1.3-2.4%, Q4_0 and Q4_K 2%, int8 and bf16 0-0.6%.
  void fuse(int A) {
    fused_ = true;
    up_left_ = std::make_unique<std::atomic<int>[]>(A);
    down_left_ = std::make_unique<std::atomic<int>[]>(A);
    h_ready_ = std::make_unique<std::atomic<bool>[]>(A);
    for (int a = 0; a < A; ++a) {
      up_left_[a].store(up_items_.chunks(), std::memory_order_relaxed);
      down_left_[a].store(down_items_.chunks(), std::memory_order_relaxed);
      h_ready_[a].store(false, std::memory_order_relaxed);
    }
    slots_left_ = std::make_unique<std::atomic<int>[]>(T_);
    for (int t = 0; t < T_; ++t) {
      int n = 0;
      for (int j = 0; j < topk_; ++j) n += slot_of_[size_t(t) * topk_ + j] >= 0;
      slots_left_[t].store(n, std::memory_order_relaxed);
      if (n == 0) unrouted_.push_back(t);
    }
  }

  // The fused phase: the gate/up items, then the down items.
  Phase fused_phase() {
    return {up_items_.items() + down_items_.items(), [this](int i, int) { fused_item(i); }};
  }

  void fused_item(int item) {
    const int ups = up_items_.items();
    int active, first, last;
    if (item < ups) {
      up_items_.locate(item, active, first, last);
      gate_up_rows(active, first, last);
      if (up_left_[active].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      const ActiveExpert& a = active_[active];
      if (quantize_h())
        for (int s = a.first_slot; s < a.first_slot + a.count; ++s) prepare_h(s);
      h_ready_[active].store(true, std::memory_order_release);
      return;
    }
    down_items_.locate(item - ups, active, first, last);
    spin_until([&] { return h_ready_[active].load(std::memory_order_acquire); });
    down_rows(active, first, last);
    if (down_left_[active].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    const ActiveExpert& a = active_[active];
    for (int s = a.first_slot; s < a.first_slot + a.count; ++s) {
      const int t = slot_token_[s];
      if (slots_left_[t].fetch_sub(1, std::memory_order_acq_rel) == 1) combine(t);
    }
  }

  void prepare_h(int s) {
    const float* h = h_.get() + size_t(s) * I_;
    h_act_.quantize(kt_, h, s);
    if (hb_) kt_->f32_to_bf16(h, hb_.get() + size_t(s) * I_, I_);
  }

  const float* x_row(int t) const {
    return x_dtype_ == kBF16Data ? xf_.get() + size_t(t) * H_ : static_cast<const float*>(x_) + size_t(t) * H_;
  }

  void prepare_token(int t) {
    if (x_dtype_ == kBF16Data)
      kt_->bf16_to_f32(static_cast<const uint16_t*>(x_) + size_t(t) * H_, xf_.get() + size_t(t) * H_, H_);
    x_act_.quantize(kt_, x_row(t), t);
    xu_act_.quantize(kt_, x_row(t), t);
    if (xq_) kt_->amx_digit_rows(x_row(t), H_, xq_hi(t), xq_lo(t), xq_d_.get() + t);
  }
  // Token t's digit rows (amx_digit_rows) in xq_: all the hi rows, then all the lo rows, 64-byte aligned
  // (H is a multiple of 64 on the digit tiles).
  int8_t* xq_hi(int t) const { return xq_base_ + size_t(t) * H_; }
  int8_t* xq_lo(int t) const { return xq_hi(t) + size_t(T_) * H_; }

  // h = act(g + gate_bias, u + up_bias) for `rows` tokens of one expert, columns [n0, n0 + R).
  void activate(int expert, int n0, int R, float* g, int ldg, float* u, int ldu, int rows) const {
    const float* gb = act_.gate_bias ? act_.gate_bias + size_t(expert) * I_ + n0 : nullptr;
    const float* ub = act_.up_bias ? act_.up_bias + size_t(expert) * I_ + n0 : nullptr;
    for (int i = 0; i < rows; ++i) {
      float* gi = g + size_t(i) * ldg;
      float* ui = u + size_t(i) * ldu;
      if (gb)
        for (int r = 0; r < R; ++r) gi[r] += gb[r];
      if (ub)
        for (int r = 0; r < R; ++r) ui[r] += ub[r];
      if (act_.kind == kSwigluOAI)
        kt_->swiglu_oai(gi, ui, gi, R, act_.alpha, act_.limit);
      else
        kt_->silu_mul(gi, ui, gi, R);
    }
  }

  void gate_up(int item) {
    int active, first, last;
    up_items_.locate(item, active, first, last);
    gate_up_rows(active, first, last);
  }
  void gate_up_rows(int active, int first, int last) {
    const ActiveExpert& a = active_[active];
    // Up to kGemvTokens tokens (decode) read each row once: the item's gate rows, then its up rows, as
    // two long streams (Zen 5, 1-token int4 decode from DRAM: 0.672 -> 0.620 ms, in-process A/B; int8
    // level). More tokens go a panel at a time, so a panel's rows stay in cache for the token groups.
    if (a.count <= kGemvTokens && a.count <= gemv_max_) return gate_up_panel(a, first, last);
    if (a.count > gemv_max_ && tile_gemm(kt_))
      return gate_up_tiles(a, x_acts(active), first, last);
    for (int n0 = first; n0 < last; n0 += kPanelRows) gate_up_panel(a, n0, std::min(last, n0 + kPanelRows));
  }

  // Phase 1's item: 16 of a tile-path expert's tokens into x_tiles_.
  void pack_x_tile(int item) {
    int g, row, n;
    x_tiles_.locate(item, g, row, n);
    pack_x(x_tiles_, item, active_[g], row, n);
  }
  // Phase 4's item: 16 of a tile-path expert's intermediate rows into h_tiles_.
  void pack_h_tile(int item) {
    int g, row, n;
    h_tiles_.locate(item, g, row, n);
    pack_h(h_tiles_, item, active_[g], row, n);
  }
  // Tile-path expert `active`'s packed tokens (intermediate rows): phase 1's (4's), or, where it has a
  // single item, packed here into the calling thread's tiles.
  engine::TileActs x_acts(int active) {
    if (x_tiles_.items()) return x_tiles_.acts(active);
    const ActiveExpert& a = active_[active];
    return tl_own_tiles.pack_alone(a.count, H_, x_forms_, [&](engine::GroupTiles& t, int item, int row, int n) {
      pack_x(t, item, a, row, n);
    });
  }
  engine::TileActs h_acts(int active) {
    if (h_tiles_.items()) return h_tiles_.acts(active);
    const ActiveExpert& a = active_[active];
    return tl_own_tiles.pack_alone(a.count, I_, h_forms_, [&](engine::GroupTiles& t, int item, int row, int n) {
      pack_h(t, item, a, row, n);
    });
  }

  // The expert's tokens [row, row + n) as tile `item` of `tiles`: as digits from phase 0's digit rows
  // where gate and up read digits only, else from the fp32 rows.
  void pack_x(engine::GroupTiles& tiles, int item, const ActiveExpert& a, int row, int n) const {
    const int* tokens = slot_token_.data() + a.first_slot + row;
    if (xq_) {
      const int8_t* hi[16];
      const int8_t* lo[16];
      float d[16];
      for (int i = 0; i < n; ++i) hi[i] = xq_hi(tokens[i]), lo[i] = xq_lo(tokens[i]), d[i] = xq_d_.get()[tokens[i]];
      tiles.pack_digit_rows(kt_, item, hi, lo, d, n);
      return;
    }
    const float* rows[16];
    for (int i = 0; i < n; ++i) rows[i] = x_row(tokens[i]);
    tiles.pack(kt_, item, rows, n);
  }
  // The expert's intermediate rows [row, row + n) as tile `item`. Packed without remainders, the rows
  // are rounded to bf16 as f32_to_bf16 rounds them (hb_).
  void pack_h(engine::GroupTiles& tiles, int item, const ActiveExpert& a, int row, int n) const {
    const float* rows[16];
    for (int i = 0; i < n; ++i) rows[i] = h_.get() + size_t(a.first_slot + row + i) * I_;
    tiles.pack(kt_, item, rows, n);
  }

  // AMX: gate and up kAmxRows rows at a time against the expert's packed tokens.
  void gate_up_tiles(const ActiveExpert& a, const engine::TileActs& x, int first, int last) {
    float* up_block = sized(tl_scratch.block, size_t(a.count) * kAmxRows);
    for (int n0 = first; n0 < last; n0 += kAmxRows) {
      const int n1 = std::min(last, n0 + kAmxRows);
      float* g = h_.get() + size_t(a.first_slot) * I_ + n0;
      // each block's rows decoded during the tiles of the one before (amx_gemm_digits' `next`)
      const RowBlock up_rows{&up_, a.expert, n0, n1 - n0};
      const RowBlock gate_next{&gate_, a.expert, n1, std::min(last, n1 + kAmxRows) - n1};
      tile_rows(kt_, gate_, a.expert, n0, n1, x, g, I_, &up_rows);
      tile_rows(kt_, up_, a.expert, n0, n1, x, up_block, kAmxRows, n1 < last ? &gate_next : nullptr);
      activate(a.expert, n0, n1 - n0, g, I_, up_block, kAmxRows, a.count);
    }
  }

  void gate_up_panel(const ActiveExpert& a, int n0, int n1) {
    const int R = n1 - n0;
    const int ldu = std::max(R, kPanelRows);
    float* up_block = sized(tl_scratch.block, size_t(std::max(a.count, kGemvTokens)) * ldu);
    if (a.count <= gemv_max_) {
      for (int t0 = 0; t0 < a.count; t0 += kGemvTokens) {
        const int nt = std::min(kGemvTokens, a.count - t0);
        const bool own_up = xu_act_.mode != kActNone;
        Act acts[kGemvTokens], up_acts[kGemvTokens];
        for (int i = 0; i < nt; ++i) {
          const int tok = slot_token_[a.first_slot + t0 + i];
          acts[i] = x_act_.act(x_row(tok), tok);
          if (own_up) up_acts[i] = xu_act_.act(x_row(tok), tok);
          if (xh_) acts[i].h = up_acts[i].h = xh_ + size_t(tok) * H_;  // Act::h
        }
        float* g = h_.get() + size_t(a.first_slot + t0) * I_ + n0;
        // Gate straight into h (row stride I), up into scratch; then h = silu(h) * up.
        kt_->gemv[gate_.method](gate_, a.expert, n0, n1, acts, nt, g, I_);
        kt_->gemv[up_.method](up_, a.expert, n0, n1, own_up ? up_acts : acts, nt, up_block, ldu);
        activate(a.expert, n0, R, g, I_, up_block, ldu, nt);
      }
      return;
    }
    float* g = h_.get() + size_t(a.first_slot) * I_ + n0;
    if (bf16_up_) {
      std::vector<const uint16_t*> rows(a.count);
      for (int i = 0; i < a.count; ++i) rows[i] = static_cast<const uint16_t*>(x_) + size_t(slot_token_[a.first_slot + i]) * H_;
      const engine::Bf16Rows wg = bf16_rows(kt_, gate_, a.expert, n0, n1, tl_scratch.panel_a, tl_scratch.bf16_a);
      const engine::Bf16Rows wu = bf16_rows(kt_, up_, a.expert, n0, n1, tl_scratch.panel_b, tl_scratch.bf16_b);
      kt_->gemm_bf16(wg.w, wg.stride, R, H_, rows.data(), a.count, g, I_);
      kt_->gemm_bf16(wu.w, wu.stride, R, H_, rows.data(), a.count, up_block, ldu);
      activate(a.expert, n0, R, g, I_, up_block, ldu, a.count);
      return;
    }
    float* pg = sized(tl_scratch.panel_a, size_t(kPanelRows) * H_);
    float* pu = sized(tl_scratch.panel_b, size_t(kPanelRows) * H_);
    kt_->dequant_rows[gate_.method](gate_, a.expert, n0, n1, pg);
    kt_->dequant_rows[up_.method](up_, a.expert, n0, n1, pu);
    std::vector<const float*> rows(a.count);
    for (int i = 0; i < a.count; ++i) rows[i] = x_row(slot_token_[a.first_slot + i]);
    kt_->gemm_panel(pg, R, H_, rows.data(), a.count, g, I_);
    kt_->gemm_panel(pu, R, H_, rows.data(), a.count, up_block, kPanelRows);
    activate(a.expert, n0, R, g, I_, up_block, kPanelRows, a.count);
  }

  void down(int item) {
    int active, first, last;
    down_items_.locate(item, active, first, last);
    down_rows(active, first, last);
  }
  void down_rows(int active, int first, int last) {
    const ActiveExpert& a = active_[active];
    // Up to kGemvTokens tokens read each row once: the item's rows in one call, as gate_up does (in
    // panels of kPanelRows a 1-token Qwen3-30B-A3B layer made 86 GEMV calls an expert for its down
    // rows; ~5 us a layer on 2 threads of the AMX Xeon).
    if (a.count <= kGemvTokens && a.count <= gemv_max_) return down_panel(a, first, last);
    if (a.count > gemv_max_ && tile_gemm(kt_))
      return down_tiles(a, h_acts(active), first, last);
    for (int n0 = first; n0 < last; n0 += kPanelRows) down_panel(a, n0, std::min(last, n0 + kPanelRows));
  }

  // AMX: down against the expert's packed intermediate rows.
  void down_tiles(const ActiveExpert& a, const engine::TileActs& x, int first, int last) {
    float* out = ybuf_.get() + size_t(a.first_slot) * H_ + first;
    tile_rows(kt_, down_, a.expert, first, last, x, out, H_);
    add_down_bias(a, first, last - first, out);
  }

  void down_panel(const ActiveExpert& a, int n0, int n1) {
    const int R = n1 - n0;
    float* out = ybuf_.get() + size_t(a.first_slot) * H_ + n0;
    if (a.count <= gemv_max_) {
      for (int t0 = 0; t0 < a.count; t0 += kGemvTokens) {
        const int nt = std::min(kGemvTokens, a.count - t0);
        Act acts[kGemvTokens];
        for (int i = 0; i < nt; ++i) {
          const int s = a.first_slot + t0 + i;
          acts[i] = h_act_.act(h_.get() + size_t(s) * I_, s);
        }
        kt_->gemv[down_.method](down_, a.expert, n0, n1, acts, nt, out + size_t(t0) * H_, H_);
      }
      add_down_bias(a, n0, R, out);
      return;
    }
    if (bf16_down_) {
      std::vector<const uint16_t*> rows(a.count);
      for (int i = 0; i < a.count; ++i) rows[i] = hb_.get() + size_t(a.first_slot + i) * I_;
      const engine::Bf16Rows wd = bf16_rows(kt_, down_, a.expert, n0, n1, tl_scratch.panel_a, tl_scratch.bf16_a);
      kt_->gemm_bf16(wd.w, wd.stride, R, I_, rows.data(), a.count, out, H_);
      add_down_bias(a, n0, R, out);
      return;
    }
    float* pd = sized(tl_scratch.panel_a, size_t(kPanelRows) * I_);
    kt_->dequant_rows[down_.method](down_, a.expert, n0, n1, pd);
    std::vector<const float*> rows(a.count);
    for (int i = 0; i < a.count; ++i) rows[i] = h_.get() + size_t(a.first_slot + i) * I_;
    kt_->gemm_panel(pd, R, I_, rows.data(), a.count, out, H_);
    add_down_bias(a, n0, R, out);
  }

  void add_down_bias(const ActiveExpert& a, int n0, int R, float* out) const {
    if (!act_.down_bias) return;
    const float* b = act_.down_bias + size_t(a.expert) * H_ + n0;
    for (int i = 0; i < a.count; ++i)
      for (int r = 0; r < R; ++r) out[size_t(i) * H_ + r] += b[r];
  }

  // Token t's output: its experts' rows weighted and summed in the kernels' vectors (a prompt of 512
  // tokens reads 8 rows of H a token: 33.5 MB in a Qwen3-30B-A3B layer, where the scalar loop of
  // this file's baseline flags took ~3.7% of the int4 layer's time on the AMX Xeon).
  void combine(int t) {
    Scratch& sc = tl_scratch;
    sc.rows.clear();
    sc.weights.clear();
    for (int j = 0; j < topk_; ++j) {
      const int s = slot_of_[t * topk_ + j];
      if (s < 0) continue;
      sc.rows.push_back(ybuf_.get() + size_t(s) * H_);
      sc.weights.push_back(weights_[t * topk_ + j]);
    }
    const bool bf16 = x_dtype_ == kBF16Data;
    float* acc = bf16 ? sized(sc.block, H_) : static_cast<float*>(y_) + size_t(t) * H_;
    kt_->weighted_sum(sc.rows.data(), sc.weights.data(), int(sc.rows.size()), H_, acc);
    if (bf16) kt_->f32_to_bf16(acc, static_cast<uint16_t*>(y_) + size_t(t) * H_, H_);
  }

  int H_, I_;
  Proj gate_, up_, down_;
  ActConfig act_;
  const KernelTable* kt_;
  int gemv_max_;
  const void* x_;
  int x_dtype_, T_, topk_;
  const float* weights_;
  void* y_;

  std::vector<ActiveExpert> active_;
  std::vector<int> slot_token_, slot_of_;
  int S_ = 0;
  engine::NodeRowItems up_items_, down_items_;  // phase 2's (rows of I) and phase 5's (rows of H)
  engine::Buf<float> xf_, h_, ybuf_;
  const uint16_t* xh_ = nullptr;  // x itself where the gate and up GEMVs may read it in bf16 (Act::h)
  engine::Buf<int8_t> xq_;  // phase 0's digit rows of the tokens, where gate and up read digits (xq_hi)
  int8_t* xq_base_ = nullptr;  // xq_ at its first 64-byte boundary
  engine::Buf<float> xq_d_;
  engine::Buf<uint16_t> hb_;  // the intermediate in bf16, for bf16_down_
  engine::TileForms x_forms_, h_forms_;  // what gate and up, and down, read on the tiles
  engine::GroupTiles x_tiles_, h_tiles_;  // the tile-path experts' tokens and intermediate rows, packed
  bool bf16_up_ = false, bf16_down_ = false;
  ActBuffers x_act_, xu_act_, h_act_;  // xu_act_: up's layout where it is not gate's
  // The fused phase's (fuse): gate/up and down items of each active expert still to finish, whether
  // its intermediate rows are ready for down, each token's slots still to finish; the tokens routed
  // to no expert here (phase 6 writes their zeros).
  bool fused_ = false;
  std::unique_ptr<std::atomic<int>[]> up_left_, down_left_, slots_left_;
  std::unique_ptr<std::atomic<bool>[]> h_ready_;
  std::vector<int> unrouted_;
};

std::mutex g_pool_mu;
std::shared_ptr<ThreadPool> g_pool;
int g_pool_threads = 0;
std::string g_numa_spec;  // "": HETMOE_NUMA

}  // namespace

std::shared_ptr<ThreadPool> global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) {
    NumaTopology topology = numa_topology(g_numa_spec);  // throws on a bad HETMOE_NUMA
    int n = g_pool_threads;
    if (n <= 0) {  // one participant per allowed CPU (every group's CPUs together)
      for (const auto& cpus : topology.node_cpus) n += static_cast<int>(cpus.size());
      if (n <= 0) n = std::max(1, int(std::thread::hardware_concurrency()));
    }
    g_pool = std::make_shared<ThreadPool>(n, std::move(topology));
  }
  return g_pool;
}

void set_pool_threads(int threads) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_pool_threads = threads;
  // The next job starts a pool of the new size; the old one finishes its jobs first (a thread
  // waiting on one of them keeps it alive until then).
  g_pool.reset();
}

void set_pool_numa(const std::string& spec) {
  numa_topology(spec);  // a bad spec throws here, not at the next job
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_numa_spec = spec;
  g_pool.reset();  // as set_pool_threads: the next job starts a pool split this way
}

int pool_threads() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  return g_pool ? g_pool->threads() : g_pool_threads;
}

MoEEngine::MoEEngine(int experts, int hidden, int intermediate, const Proj& gate, const Proj& up, const Proj& down,
                     const ActConfig& act, const KernelTable* kernels, int gemv_max_tokens)
    : E_(experts), H_(hidden), I_(intermediate), gate_(gate), up_(up), down_(down), act_(act), kt_(kernels),
      gemv_max_(gemv_max_tokens),
      split_(split_experts(experts, hidden, intermediate, gate, up, down, global_pool()->topology())) {}

std::shared_ptr<Job> MoEEngine::start(const void* x, int x_dtype, int tokens, const int64_t* ids, int topk,
                                      const float* weights, void* y, const uint8_t* skip_mask) {
  std::shared_ptr<ThreadPool> pool = global_pool();
  auto job = std::make_shared<MoEJob>(E_, H_, I_, gate_, up_, down_, act_, kt_, gemv_max_, split_, x, x_dtype,
                                      tokens, ids, topk, weights, y, skip_mask, pool->threads());
  pool->submit(job);
  return job;
}

int64_t MoEEngine::submit(const void* x, int x_dtype, int tokens, const int64_t* ids, int topk,
                          const float* weights, void* y, const uint8_t* skip_mask) {
  return jobs_.add(start(x, x_dtype, tokens, ids, topk, weights, y, skip_mask));
}

bool MoEEngine::wait(int64_t handle) { return jobs_.wait(handle); }

void MoEEngine::forward(const void* x, int x_dtype, int tokens, const int64_t* ids, int topk, const float* weights,
                        void* y, const uint8_t* skip_mask) {
  start(x, x_dtype, tokens, ids, topk, weights, y, skip_mask)->wait();
}

int MoEEngine::pending() const { return jobs_.size(); }

}  // namespace hetmoe
