// SVG → PNG through an external renderer, when the machine has one: rsvg-convert (librsvg2-bin)
// or else ImageMagick's convert. Used for the pipeline pictures (`shardtrain pipeline-sim
// --output`, measured pipeline traces), whose SVG is always written; the PNG is a convenience.
#pragma once

#include <filesystem>
#include <string>

namespace shardtrain {

/// The renderer render_png would use: the full path of rsvg-convert on PATH, else of ImageMagick's
/// convert, else "".
std::string png_renderer();

/// Renders the SVG file `svg` to `png`. Runs the renderer directly (posix_spawn with an argument
/// vector: no shell, so no quoting of the paths is involved), its output discarded; writes to a
/// temporary name next to `png` and renames it once the result starts with the PNG signature.
/// Returns false, with no error and nothing left at `png`'s temporary name, when no renderer is
/// found or it fails.
bool render_png(const std::filesystem::path& svg, const std::filesystem::path& png);

}  // namespace shardtrain
