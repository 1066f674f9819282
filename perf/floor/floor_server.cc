// The floor: a compiled no-op Envoy ext_proc v3 processor (perf/bench_overhead.py's `floor` setup).
//
// What: a gRPC C++ server (gRPC's async API, one completion queue and one thread per `--threads`)
// serving envoy.service.ext_proc.v3.ExternalProcessor/Process. Every message Envoy sends is answered
// with the matching empty response (request_headers -> HeadersResponse{CommonResponse{CONTINUE}},
// request_body -> BodyResponse{...}, trailers -> empty TrailersResponse, ...), prebuilt once, so the
// server does nothing but read, match the oneof and write: the cost of the ext_proc round trip itself.
// It also serves grpc.health.v1.Health (gRPC's default health service) with SERVING for "" and for
// "envoy.service.ext_proc.v3.ExternalProcessor", the service name the gateway's rendered processor
// cluster health-checks, so the floor runs behind exactly the gateway's Envoy config.
// Why: the lowest cost a processor behind this Envoy config can have; our processor is measured as a
// ratio to it (issue 13).
// Usage: ext_proc_floor --port P [--port P2 ...] [--threads N]
//   --port     listen on 127.0.0.1:P (repeatable: one port per processor-cluster endpoint, so Envoy
//              opens one HTTP/2 connection per endpoint as it does to our workers)
//   --threads  completion-queue threads (default: the CPU count)
//   --host     listen address (default 127.0.0.1)
// Prints "ready" on stdout once serving; SIGTERM/SIGINT stop it (exit 0).
// Build: perf/floor/build.sh (or `make floor`) -> .tools/floor/ext_proc_floor.
// Proto: perf/floor/ext_proc.proto, a minimal wire-compatible subset of the real one (fields a no-op
// never reads are skipped as unknown fields by protobuf).

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "ext_proc.grpc.pb.h"

namespace ep = envoy::service::ext_proc::v3;

namespace {

struct Replies {
  ep::ProcessingResponse request_headers, response_headers, request_body, response_body,
      request_trailers, response_trailers;
  Replies() {
    request_headers.mutable_request_headers()->mutable_response();
    response_headers.mutable_response_headers()->mutable_response();
    request_body.mutable_request_body()->mutable_response();
    response_body.mutable_response_body()->mutable_response();
    request_trailers.mutable_request_trailers();
    response_trailers.mutable_response_trailers();
  }
  const ep::ProcessingResponse* For(const ep::ProcessingRequest& req) const {
    switch (req.request_case()) {
      case ep::ProcessingRequest::kRequestHeaders: return &request_headers;
      case ep::ProcessingRequest::kResponseHeaders: return &response_headers;
      case ep::ProcessingRequest::kRequestBody: return &request_body;
      case ep::ProcessingRequest::kResponseBody: return &response_body;
      case ep::ProcessingRequest::kRequestTrailers: return &request_trailers;
      case ep::ProcessingRequest::kResponseTrailers: return &response_trailers;
      default: return nullptr;  // nothing to answer (not sent by Envoy)
    }
  }
};

const Replies* kReplies = nullptr;

// One Process stream: REQUEST -> (READ -> WRITE)* -> FINISH. One operation in flight at a time:
// Envoy waits for each reply before the next message of a non-streamed phase, and in a STREAMED
// phase the next chunk simply waits in gRPC's buffer until the reply to the previous one is written.
class Stream {
 public:
  Stream(ep::ExternalProcessor::AsyncService* svc, grpc::ServerCompletionQueue* cq)
      : svc_(svc), cq_(cq), io_(&ctx_) {
    svc_->RequestProcess(&ctx_, &io_, cq_, cq_, this);
  }

  void Proceed(bool ok) {
    switch (state_) {
      case State::kRequest:
        if (!ok) { delete this; return; }  // the server is shutting down
        new Stream(svc_, cq_);            // the next stream's slot
        Read();
        return;
      case State::kRead: {
        if (!ok) { Finish(); return; }  // Envoy closed its side: the request is done
        const ep::ProcessingResponse* reply = kReplies->For(req_);
        if (reply == nullptr) { Read(); return; }
        state_ = State::kWrite;
        io_.Write(*reply, this);
        return;
      }
      case State::kWrite:
        if (!ok) { Finish(); return; }
        Read();
        return;
      case State::kFinish:
        delete this;
        return;
    }
  }

 private:
  enum class State { kRequest, kRead, kWrite, kFinish };
  void Read() { state_ = State::kRead; io_.Read(&req_, this); }
  void Finish() { state_ = State::kFinish; io_.Finish(grpc::Status::OK, this); }

  ep::ExternalProcessor::AsyncService* svc_;
  grpc::ServerCompletionQueue* cq_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<ep::ProcessingResponse, ep::ProcessingRequest> io_;
  ep::ProcessingRequest req_;
  State state_ = State::kRequest;
};

void Serve(ep::ExternalProcessor::AsyncService* svc, grpc::ServerCompletionQueue* cq) {
  for (int i = 0; i < 64; ++i) new Stream(svc, cq);  // streams that may start at once on this queue
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) static_cast<Stream*>(tag)->Proceed(ok);
}

[[noreturn]] void Usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s --port P [--port P2 ...] [--threads N] [--host ADDR]\n", argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ports;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  std::string host = "127.0.0.1";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) Usage(argv[0]);
    if (a == "--port") ports.push_back(std::atoi(argv[++i]));
    else if (a == "--threads") threads = std::atoi(argv[++i]);
    else if (a == "--host") host = argv[++i];
    else Usage(argv[0]);
  }
  if (ports.empty() || threads < 1) Usage(argv[0]);

  // SIGTERM/SIGINT are taken by sigwait in main only (blocked before any thread starts).
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  Replies replies;
  kReplies = &replies;
  grpc::EnableDefaultHealthCheckService(true);
  ep::ExternalProcessor::AsyncService service;
  grpc::ServerBuilder builder;
  std::vector<int> bound(ports.size(), 0);
  for (size_t i = 0; i < ports.size(); ++i)
    builder.AddListeningPort(host + ":" + std::to_string(ports[i]), grpc::InsecureServerCredentials(), &bound[i]);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs;
  for (int i = 0; i < threads; ++i) cqs.push_back(builder.AddCompletionQueue());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) { std::fprintf(stderr, "ext_proc_floor: could not start the server\n"); return 3; }
  for (size_t i = 0; i < ports.size(); ++i) {
    if (bound[i] == 0) { std::fprintf(stderr, "ext_proc_floor: cannot bind port %d\n", ports[i]); return 3; }
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus("envoy.service.ext_proc.v3.ExternalProcessor", true);
  }
  std::vector<std::thread> workers;
  for (auto& cq : cqs) workers.emplace_back(Serve, &service, cq.get());
  std::printf("ready\n");
  std::fflush(stdout);

  int sig = 0;
  sigwait(&stop, &sig);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  std::fflush(stdout);
  std::_Exit(0);  // a benchmark helper: no need to drain the queues of pending stream slots
}
