#include "fsdpp/train/sharding.hpp"

#include <ATen/ATen.h>

#include "fsdpp/comm/flight_recorder.hpp"

namespace fsdpp::train {

namespace {

// models::TokenExchange over a communicator: one all-to-all per exchange, waited at once (the rows
// are needed next), labelled for flight records and traces.
class CommTokenExchange final : public models::TokenExchange {
 public:
  explicit CommTokenExchange(comm::Comm ep) : ep_(std::move(ep)) {}
  int rank() const override { return ep_.rank(); }
  int size() const override { return ep_.size(); }
  void exchange_counts(const at::Tensor& out, const at::Tensor& in) override {
    static const std::string kLabel = "moe all_to_all counts";
    comm::OpLabel op_label(&kLabel);
    ep_.all_to_all(out, in).wait();
  }
  at::Tensor exchange_rows(const at::Tensor& x, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, const std::string& label) override {
    const int64_t width = x.size(1);
    int64_t total = 0;
    for (auto r : recv_rows) total += r;
    auto out = at::empty({total, width}, x.options());
    const auto elements = [width](std::vector<int64_t> rows) {
      for (auto& r : rows) r *= width;
      return rows;
    };
    comm::OpLabel op_label(&label);
    ep_.all_to_all(out, x.contiguous(), {elements(send_rows), elements(recv_rows)}).wait();
    return out;
  }

 private:
  comm::Comm ep_;
};

}  // namespace

std::shared_ptr<models::TokenExchange> token_exchange(comm::Comm ep) {
  return std::make_shared<CommTokenExchange>(std::move(ep));
}

}  // namespace fsdpp::train
