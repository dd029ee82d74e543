// Host layout transform and the checks both the host and the CUDA path share. Units that are
// contiguous on both ends become one memcpy (a whole NHD->NHD segment, or a head's run of
// tokens between HND layouts); a large call is cut into pieces of about equal bytes, each
// thread taking a run of them, because one core's memcpy bandwidth is well below what host
// memory gives to several.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "fill_helpers.h"
#include "transform.h"

namespace kvxfer {
namespace {

constexpr std::int64_t kBytesPerThread = 4ll << 20;  // below this a thread costs more than it saves

// *acc += b * c, all non-negative; false (and *acc unchanged) where that leaves int64.
bool add_product(std::int64_t* acc, std::int64_t b, std::int64_t c) {
  if (b != 0 && c > (std::numeric_limits<std::int64_t>::max() - *acc) / b) return false;
  *acc += b * c;
  return true;
}

// The last byte of one end of a segment, past unit_bytes: false where it lies past int64.
bool end_fits(std::int64_t addr, std::int64_t tokens, std::int64_t token_stride, std::int64_t heads,
              std::int64_t head_stride, std::int64_t unit_bytes) {
  std::int64_t end = addr;
  return add_product(&end, tokens - 1, token_stride) && add_product(&end, heads - 1, head_stride) &&
         add_product(&end, 1, unit_bytes);
}

std::string at(const char* what, std::int64_t i, std::int64_t v) {
  return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(v);
}

// Tokens [t0, t1) of segment `seg`.
void copy_tokens(const TransformPlan& p, std::int64_t seg, std::int64_t t0, std::int64_t t1) {
  const auto* src = reinterpret_cast<const unsigned char*>(p.src_addr[seg]) + t0 * p.src_token_stride;
  auto* dst = reinterpret_cast<unsigned char*>(p.dst_addr[seg]) + t0 * p.dst_token_stride;
  const std::int64_t n_tok = t1 - t0, heads = p.heads, u = p.unit_bytes;
  const std::int64_t sts = p.src_token_stride, dts = p.dst_token_stride;
  const std::int64_t shs = p.src_head_stride, dhs = p.dst_head_stride;
  if (heads == 1 || (shs == u && dhs == u)) {  // a token's heads are one run on both ends
    const std::int64_t run = heads * u;
    if (n_tok == 1 || (sts == run && dts == run)) {
      std::memmove(dst, src, static_cast<std::size_t>(n_tok * run));
      return;
    }
    for (std::int64_t t = 0; t < n_tok; ++t) std::memmove(dst + t * dts, src + t * sts, static_cast<std::size_t>(run));
    return;
  }
  if (n_tok == 1 || (sts == u && dts == u)) {  // a head's tokens are one run on both ends
    const std::int64_t run = n_tok * u;
    if (shs == run && dhs == run) {
      std::memmove(dst, src, static_cast<std::size_t>(heads * run));
      return;
    }
    for (std::int64_t h = 0; h < heads; ++h) std::memmove(dst + h * dhs, src + h * shs, static_cast<std::size_t>(run));
    return;
  }
  for (std::int64_t t = 0; t < n_tok; ++t) {
    for (std::int64_t h = 0; h < heads; ++h)
      std::memmove(dst + t * dts + h * dhs, src + t * sts + h * shs, static_cast<std::size_t>(u));
  }
}

struct Piece {
  std::int64_t seg, t0, t1;
};

void copy_pieces(const TransformPlan& p, const std::vector<Piece>& pieces, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) copy_tokens(p, pieces[i].seg, pieces[i].t0, pieces[i].t1);
}

}  // namespace

namespace {

// The first segment that check_transform refuses, by name; empty when the fast pass of
// scan_transform was only cautious (its address bound uses the largest address and count).
std::string find_refusal(const TransformPlan& p) {
  for (std::int64_t i = 0; i < p.n_segments; ++i) {
    const std::int64_t t = p.tokens[i];
    if (t < 0) return at("tokens", i, t) + " is negative";
    if (t == 0) continue;
    if (t > 1 && p.dst_token_stride < p.unit_bytes)
      return "destination tokens overlap: dst_token_stride " + std::to_string(p.dst_token_stride) +
             " < unit_bytes " + std::to_string(p.unit_bytes) + " (segment " + std::to_string(i) + ")";
    const std::int64_t s = p.src_addr[i], d = p.dst_addr[i];
    if (s <= 0) return at("src_addr", i, s) + " is not an address";
    if (d <= 0) return at("dst_addr", i, d) + " is not an address";
    if (!end_fits(s, t, p.src_token_stride, p.heads, p.src_head_stride, p.unit_bytes))
      return "segment " + std::to_string(i) + "'s source runs past the end of the address space";
    if (!end_fits(d, t, p.dst_token_stride, p.heads, p.dst_head_stride, p.unit_bytes))
      return "segment " + std::to_string(i) + "'s destination runs past the end of the address space";
  }
  return {};
}

}  // namespace

namespace {

constexpr std::int64_t kScanPerThread = 8192;  // segments below which waking a helper costs more than it saves

struct ScanPart {
  std::uint64_t bad = 0;
  std::uint64_t or_s = 0, or_d = 0;  // of the moving segments' addresses: alignment, and a bound on the largest
  std::int64_t max_t = 0;
  std::uint64_t total = 0, moving = 0;
};

// One pass over segments [begin, end) without branches (a large call has tens of thousands
// of segments, and this pass is most of a call's host time); which segment is wrong, and
// how, is looked for only when something is. With kCopy, each segment's (src, dst, tokens)
// also goes to out[i], out[n + i], out[2n + i].
template <bool kCopy>
void scan_range(const TransformPlan& p, std::int64_t begin, std::int64_t end, std::int64_t* out, ScanPart* r) {
  const std::int64_t n = p.n_segments;
  ScanPart a;
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t t = p.tokens[i], s = p.src_addr[i], d = p.dst_addr[i];
    if (kCopy) {
      out[i] = s;
      out[n + i] = d;
      out[2 * n + i] = t;
    }
    const std::uint64_t moving = -static_cast<std::uint64_t>(t > 0);
    a.bad |= static_cast<std::uint64_t>(t < 0) | (moving & static_cast<std::uint64_t>((s <= 0) | (d <= 0)));
    a.or_s |= static_cast<std::uint64_t>(s) & moving;
    a.or_d |= static_cast<std::uint64_t>(d) & moving;
    a.max_t = std::max(a.max_t, t);
    a.total += static_cast<std::uint64_t>(t) & moving;  // exact unless n * max_t passes int64 (checked after)
    a.moving += moving & 1;
  }
  *r = a;
}

TransformScan scan(const TransformPlan& p, std::int64_t* out, int threads) {
  TransformScan r;
  auto refuse = [&r](std::string why) {
    r.error = std::move(why);
    return r;
  };
  if (p.n_segments < 0) return refuse("the number of segments is negative");
  if (p.heads < 1) return refuse("heads must be at least 1, got " + std::to_string(p.heads));
  if (p.unit_bytes < 1) return refuse("unit_bytes must be at least 1, got " + std::to_string(p.unit_bytes));
  if (p.src_token_stride < 0) return refuse("src_token_stride is negative (" + std::to_string(p.src_token_stride) + ")");
  if (p.src_head_stride < 0) return refuse("src_head_stride is negative (" + std::to_string(p.src_head_stride) + ")");
  if (p.dst_token_stride < 0) return refuse("dst_token_stride is negative (" + std::to_string(p.dst_token_stride) + ")");
  if (p.dst_head_stride < 0) return refuse("dst_head_stride is negative (" + std::to_string(p.dst_head_stride) + ")");
  if (p.n_segments == 0) return r;
  if (p.src_addr == nullptr || p.dst_addr == nullptr || p.tokens == nullptr) return refuse("a segment array is missing");
  // Two units of one segment landing on the same destination bytes would leave either one
  // there; refused only where it is certain (a stride below a unit along a dimension).
  if (p.heads > 1 && p.dst_head_stride < p.unit_bytes)
    return refuse("destination heads overlap: dst_head_stride " + std::to_string(p.dst_head_stride) +
                  " < unit_bytes " + std::to_string(p.unit_bytes));

  const std::int64_t n = p.n_segments;
  const std::int64_t parts = std::max<std::int64_t>(1, std::min<std::int64_t>(threads, n / kScanPerThread));
  std::vector<ScanPart> done(static_cast<std::size_t>(parts));
  auto run = [&](std::int64_t k) {
    const std::int64_t b = n * k / parts, e = n * (k + 1) / parts;
    if (out != nullptr) scan_range<true>(p, b, e, out, &done[static_cast<std::size_t>(k)]);
    else scan_range<false>(p, b, e, out, &done[static_cast<std::size_t>(k)]);
  };
  if (parts == 1) {
    run(0);
  } else {
    // A large staged call: the helpers that fill the row copy's index staging share the pass.
    std::atomic<std::int64_t> next{0};
    auto claim = [&] {
      for (std::int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < parts;) run(k);
    };
    FillHelpers::Lease helpers(FillHelpers::instance());
    helpers.lend(claim, static_cast<std::size_t>(parts - 1));
    claim();
    helpers.join();
  }
  ScanPart a;
  for (const ScanPart& d : done) {
    a.bad |= d.bad;
    a.or_s |= d.or_s;
    a.or_d |= d.or_d;
    a.max_t = std::max(a.max_t, d.max_t);
    a.total += d.total;
    a.moving += d.moving;
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  bool bad = a.bad != 0 || (a.max_t > 1 && p.dst_token_stride < p.unit_bytes);
  // The addresses' OR is at least the largest address: a bound that refuses nothing real.
  if (a.moving > 0) {
    const auto or_s = static_cast<std::int64_t>(a.or_s & static_cast<std::uint64_t>(kMax));
    const auto or_d = static_cast<std::int64_t>(a.or_d & static_cast<std::uint64_t>(kMax));
    bad = bad || !end_fits(or_s, a.max_t, p.src_token_stride, p.heads, p.src_head_stride, p.unit_bytes) ||
          !end_fits(or_d, a.max_t, p.dst_token_stride, p.heads, p.dst_head_stride, p.unit_bytes);
  }
  if (bad) {
    std::string why = find_refusal(p);
    if (!why.empty()) return refuse(std::move(why));
  }
  if (a.max_t > 0 && a.max_t > kMax / n) {  // the sum may have wrapped: add it up with checks
    std::int64_t total = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (p.tokens[i] > 0 && __builtin_add_overflow(total, p.tokens[i], &total))
        return refuse("the segments' tokens add up past int64");
    }
    a.total = static_cast<std::uint64_t>(total);
  }
  r.moving = static_cast<std::int64_t>(a.moving);
  r.max_tokens = a.max_t;
  r.total_tokens = static_cast<std::int64_t>(a.total);
  std::uint64_t acc = a.or_s | a.or_d | static_cast<std::uint64_t>(p.unit_bytes);
  if (p.heads > 1) acc |= static_cast<std::uint64_t>(p.src_head_stride | p.dst_head_stride);
  if (a.max_t > 1) acc |= static_cast<std::uint64_t>(p.src_token_stride | p.dst_token_stride);
  for (int w : {16, 8, 4, 1}) {
    if (acc % static_cast<std::uint64_t>(w) == 0) {
      r.width = w;
      break;
    }
  }
  return r;
}

}  // namespace

TransformScan scan_transform(const TransformPlan& p) { return scan(p, nullptr, 1); }

TransformScan scan_transform_into(const TransformPlan& p, std::int64_t* out, int threads) {
  return scan(p, out, threads);
}

std::string check_transform(const TransformPlan& p) { return scan_transform(p).error; }

std::string host_transform(const TransformPlan& p, int threads) {
  const TransformScan scan = scan_transform_into(p, nullptr, 4);
  if (!scan.error.empty() || scan.moving == 0) return scan.error;
  const std::int64_t token_bytes = p.heads * p.unit_bytes;
  std::int64_t total = 0;
  if (__builtin_mul_overflow(scan.total_tokens, token_bytes, &total)) total = std::numeric_limits<std::int64_t>::max();
  std::int64_t want;
  if (threads > 0) {
    want = threads;
  } else {
    const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
    want = std::max<std::int64_t>(1, std::min<std::int64_t>({total / kBytesPerThread, hw, 64}));
  }
  if (want == 1) {
    for (std::int64_t i = 0; i < p.n_segments; ++i) {
      if (p.tokens[i] > 0) copy_tokens(p, i, 0, p.tokens[i]);
    }
    return {};
  }
  // Pieces of at most `share` bytes (a segment larger than that is cut at token boundaries),
  // then each thread takes a run of pieces holding about `share` bytes.
  const std::int64_t share = (total + want - 1) / want;
  const std::int64_t tokens_per_piece = std::max<std::int64_t>(1, share / token_bytes);
  std::vector<Piece> pieces;
  std::vector<std::size_t> cuts{0};  // thread k copies pieces [cuts[k], cuts[k + 1])
  try {
    std::int64_t filled = 0;
    for (std::int64_t i = 0; i < p.n_segments; ++i) {
      for (std::int64_t t0 = 0; t0 < p.tokens[i]; t0 += tokens_per_piece) {
        const std::int64_t t1 = std::min(p.tokens[i], t0 + tokens_per_piece);
        pieces.push_back({i, t0, t1});
        filled += (t1 - t0) * token_bytes;
        if (filled >= share) {
          cuts.push_back(pieces.size());
          filled = 0;
        }
      }
    }
    if (cuts.back() != pieces.size()) cuts.push_back(pieces.size());
  } catch (const std::exception& ex) {
    return std::string("could not plan the host transform: ") + ex.what();
  }
  std::vector<std::thread> pool;
  const std::size_t runs = cuts.size() - 1;
  std::size_t started = 1;  // run 0 is the caller's
  try {
    pool.reserve(runs - 1);
    for (; started < runs; ++started)
      pool.emplace_back(copy_pieces, std::cref(p), std::cref(pieces), cuts[started], cuts[started + 1]);
  } catch (const std::exception&) {
    // Runs whose thread did not start are copied below, on this thread.
  }
  copy_pieces(p, pieces, cuts[0], cuts[1]);
  // Whatever threads started must finish before we return: they read the caller's memory.
  for (auto& th : pool) th.join();
  if (started < runs) copy_pieces(p, pieces, cuts[started], cuts[runs]);
  return {};
}

}  // namespace kvxfer
