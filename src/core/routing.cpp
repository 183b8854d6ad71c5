#include "routing.h"

#include <algorithm>
#include <stdexcept>
#include <string>

KT_NAMESPACE_BEGIN

void Routing::bucket(const int64_t* ids, const float* weights, int tokens, int top_k, const std::vector<uint8_t>& skip,
                     int parts_per_row) {
  const int E = int(skip.size()), K = top_k;
  // Count, then place.
  next_row_.assign(E, 0);
  for (int t = 0; t < tokens; ++t)
    for (int k = 0; k < K; ++k) {
      const int64_t id = ids[size_t(t) * K + k];
      if (id == -1) continue;
      if (id < 0 || id >= E)
        throw std::invalid_argument("topk_ids[" + std::to_string(t) + ", " + std::to_string(k) + "] = " +
                                    std::to_string(id) + " is outside [-1, " + std::to_string(E) + ")");
      if (!skip[id]) ++next_row_[id];
    }
  active_experts.clear();
  offset.clear();
  total_rows = max_rows = 0;
  for (int e = 0; e < E; ++e) {
    const int rows = next_row_[e];
    if (rows == 0) continue;
    active_experts.push_back(e);
    offset.push_back(total_rows);
    next_row_[e] = total_rows;
    total_rows += rows;
    max_rows = std::max(max_rows, rows);
  }
  offset.push_back(total_rows);
  token.resize(total_rows);
  weight.resize(total_rows);
  parts.resize(size_t(total_rows) * parts_per_row);
  token_rows.assign(size_t(tokens) * K, -1);
  for (int t = 0; t < tokens; ++t)
    for (int k = 0; k < K; ++k) {
      const int64_t id = ids[size_t(t) * K + k];
      if (id == -1 || skip[id]) continue;
      const int row = next_row_[id]++;
      token_rows[size_t(t) * K + k] = row;
      token[row] = t;
      weight[row] = weights[size_t(t) * K + k];
      for (int p = 0; p < parts_per_row; ++p) parts[size_t(row) * parts_per_row + p] = t * parts_per_row + p;
    }
}

KT_NAMESPACE_END
