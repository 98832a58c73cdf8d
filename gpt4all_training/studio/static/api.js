// The JSON API under /api/, as the pages use it. Every error the studio sends is {"error": "error: ..."}, the line the
// CLI prints; call() throws it as an Error whose message is that line.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  try {
    return new ApiError(response.status, (await response.json()).error);
  } catch {
    return new ApiError(response.status, `error: HTTP ${response.status}`);
  }
}

export async function call(method, path, body) {
  const options = {method, headers: {}};
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export const get = path => call("GET", path);
export const post = (path, body) => call("POST", path, body ?? {});

// A file's bytes as the body of POST /api/upload?path=...
export async function upload(path, file) {
  const response = await fetch(`/api/upload?path=${encodeURIComponent(path)}`, {method: "POST", body: file});
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// A job (map, curate, eval, export): started, then polled until it ends; `onUpdate(job)` sees every state.
export async function runJob(kind, body, onUpdate) {
  let job = await post(`/api/jobs/${kind}`, body);
  onUpdate(job);
  while (job.state === "running") {
    await new Promise(resolve => setTimeout(resolve, 400));
    job = await get(`/api/jobs/${job.id}`);
    onUpdate(job);
  }
  if (job.state === "failed") throw new ApiError(400, job.error);
  return job.result;
}

// Server-sent events from a POST (EventSource only GETs): calls onEvent(data) per `data:` line as it arrives.
export async function postStream(path, body, onEvent) {
  const response = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
                                      body: JSON.stringify(body)});
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const message = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of message.split("\n")) {
        if (line.startsWith("data: ")) onEvent(JSON.parse(line.slice(6)));
      }
    }
  }
}
