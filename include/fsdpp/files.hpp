#pragma once
// File helpers shared by checkpoints, the trainer, reports and flight records.

#include <nlohmann/json.hpp>
#include <string>

namespace fsdpp {

// Writes `text` to `path` through `path`.tmp and a rename, so that a reader (or a crash) never sees
// half a file under the final name. Throws std::runtime_error naming the file when writing fails.
void write_file_atomically(const std::string& path, const std::string& text);

// Parses a JSON file. Throws std::runtime_error: "<path> is missing" or "<path> is not valid JSON: ...".
nlohmann::json read_json_file(const std::string& path);

}  // namespace fsdpp
