// The routed (token, expert) pairs of one call, bucketed by expert so that each expert's rows lie
// together: what the engine's tasks read to find their tokens, weights and output rows.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

KT_NAMESPACE_BEGIN

struct Routing {
  std::vector<int> active_experts;  // experts with work, in id order
  std::vector<int> offset;          // per active expert: its first routed row; last = total rows
  std::vector<int32_t> token;       // per routed row: its token
  std::vector<float> weight;        // per routed row: its routing weight
  std::vector<int32_t> parts;       // per routed row, per part: its quantized hidden row
  std::vector<int32_t> token_rows;  // per token, per top-k slot: its routed row (-1: none)
  int total_rows = 0;               // routed rows
  int max_rows = 0;                 // the most routed rows of one expert

  // ids and weights [tokens, top_k]: id -1, and experts with skip[e] (skip: one per expert), route
  // nowhere. Each token's activation row is `parts` quantized rows (QuantizedBuffer). An id outside
  // [-1, experts) is a std::invalid_argument naming it.
  void bucket(const int64_t* ids, const float* weights, int tokens, int top_k, const std::vector<uint8_t>& skip,
              int parts);

 private:
  std::vector<int> next_row_;  // per expert id: its routed rows (counting pass), then its next free row
};

KT_NAMESPACE_END
