#pragma once
// Paths a user names, and the rules every command keeps with them (docs/cli.md, "Files"):
//  - a reader opens only a regular file (links followed): never blocks on a FIFO or reads a device;
//  - a writer never follows a symbolic link where it creates or truncates a file;
//  - an output is never one of the command's inputs, and an existing file is replaced only when
//    asked (--overwrite).
// Header-only, with the standard library alone: the pipeline's table reader uses it too.

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdpp {

// A path a user named that is not what the command needs: a FIFO where a file belongs, an output
// that is an input, an existing file without --overwrite, a link where fsdpp writes. The CLI exits
// with status 2 on it, as on every other bad input.
class BadInput : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a file system entry is, in words: "a regular file", "a directory", "a FIFO" ...
inline std::string kind_of(std::filesystem::file_type type) {
  using T = std::filesystem::file_type;
  switch (type) {
    case T::regular:
      return "a regular file";
    case T::directory:
      return "a directory";
    case T::symlink:
      return "a symbolic link";
    case T::fifo:
      return "a FIFO";
    case T::socket:
      return "a socket";
    case T::character:
      return "a character device";
    case T::block:
      return "a block device";
    case T::not_found:
    case T::none:
      return "missing";
    default:
      return "of an unknown kind";
  }
}

// The same from a stat(2) mode.
inline std::string kind_of_mode(mode_t mode) {
  using T = std::filesystem::file_type;
  if (S_ISREG(mode)) return kind_of(T::regular);
  if (S_ISDIR(mode)) return kind_of(T::directory);
  if (S_ISLNK(mode)) return kind_of(T::symlink);
  if (S_ISFIFO(mode)) return kind_of(T::fifo);
  if (S_ISSOCK(mode)) return kind_of(T::socket);
  if (S_ISCHR(mode)) return kind_of(T::character);
  if (S_ISBLK(mode)) return kind_of(T::block);
  return kind_of(T::unknown);
}

// Throws BadInput unless `path` (links followed) is a regular file: "<what> <path> is
// missing" or "<what> <path> is a FIFO (named pipe), not a regular file". `what` names the role
// ("schedule table", "tokenizer"). Every reader of a path a user names calls it before opening.
inline void require_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const auto type = std::filesystem::status(path, ec).type();
  if (type == std::filesystem::file_type::regular) return;
  const std::string who = (what.empty() ? "" : what + " ") + path;
  if (type == std::filesystem::file_type::not_found || type == std::filesystem::file_type::none)
    throw BadInput(who + " is missing");
  throw BadInput(who + " is " + kind_of(type) + ", not a regular file");
}

// Checks an output path before a command writes it: not a directory, not one of `inputs` (files
// the command reads, or directories it reads from: nothing inside one either), and, unless
// `overwrite`, not an existing file. Throws BadInput naming the path and the way out.
inline void check_output_file(const std::string& output, const std::vector<std::string>& inputs,
                              bool overwrite) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto out = fs::weakly_canonical(fs::absolute(output), ec);
  for (const auto& in : inputs) {
    const auto i = fs::weakly_canonical(fs::absolute(in), ec);
    const auto [end, _] = std::mismatch(i.begin(), i.end(), out.begin(), out.end());
    if (out == i || end == i.end())
      throw BadInput(output + " is " + (out == i ? "" : "inside ") + in +
                     ", which this command reads: write the output elsewhere");
  }
  const auto type = fs::symlink_status(output, ec).type();
  if (type == fs::file_type::directory) throw BadInput(output + " is a directory: name a file");
  if (type != fs::file_type::not_found && type != fs::file_type::none && !overwrite)
    throw BadInput(output + " exists (" + kind_of(type) + "): pass --overwrite to replace it");
}

}  // namespace fsdpp
