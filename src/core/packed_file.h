// A layer's packed experts (ExpertWeights) in a file that later loads map read-only instead of
// packing again: KTMoEWrapper's mmap_experts_dir (the key that names the file, the lock and the
// fall back to packing: kt_kernel.expert_cache; docs/expert-cache.md).
//
// The file: a header page (FileHeader, the packed mask, the caller's meta bytes), then every
// projection's values, scales and zero points and the biases, each at a 4096-byte boundary (2 MiB
// for those of 2 MiB or more), as the kernels read them (PackedProjection), the file padded to whole
// pages. Experts not packed (GPU experts left out of CPU memory) are holes that read as zeros.
// Native byte order: a file is read only by the build that wrote it (the header names the build).
#pragma once

#include <cstdint>
#include <string>

#include "common.h"
#include "engine.h"  // MoEShape
#include "formats.h"
#include "packed_weights.h"

KT_NAMESPACE_BEGIN

// Bump whenever a format's packed layout (kernels.h) or this file's layout changes: files of other
// versions are refused and packed again.
// 2: sections at 2 MiB; 3: E4M3 scales and factors; 4: GGUF's value planes, fp16 scales and factors,
// 6-bit multiples, mins held as themselves.
constexpr uint32_t kPackedFileVersion = 4;

// Writes `w` (loaded, in the engine's `shape` and `format`) and `meta` to a new file `path` (it must
// not exist yet), synced to disk. std::system_error naming the path where a write fails (a full or
// read-only disk); the partial file is removed first.
void write_packed_file(const std::string& path, const ExpertWeights& w, const MoEShape& shape,
                       const FormatTraits& format, const std::string& meta);

// Maps the file `path` read-only and views its projections in `w` (kept mapped while viewed), with
// its packed mask and biases; returns "" and sets *meta to the bytes write_packed_file was given. Otherwise
// the reason the file cannot be used, with `w` unchanged: not a regular file, too short, another
// magic, version, build, format or shape, a header checksum that disagrees, sizes that are not the
// format's layout, experts missing that the engine computes (`w.skip`), and with verify_content the
// checksum of the weights (a read of the whole file).
std::string map_packed_file(const std::string& path, ExpertWeights& w, const MoEShape& shape,
                            const FormatTraits& format, bool verify_content, std::string* meta);

KT_NAMESPACE_END
