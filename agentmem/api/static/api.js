// The REST client of the page. Every call carries the tenant's key as a bearer token; the
// key lives in sessionStorage so it survives reloads but not the browser tab.

const KEY = "agentmem.key";
const BASE = new URL("..", window.location.href).pathname.replace(/\/$/, "");

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function getKey() { return sessionStorage.getItem(KEY) || ""; }
export function setKey(key) { sessionStorage.setItem(KEY, key); }
export function forgetKey() { sessionStorage.removeItem(KEY); }

const enc = encodeURIComponent;

async function request(method, path, body) {
  const headers = { Authorization: `Bearer ${getKey()}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(BASE + path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 204) return null;
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!res.ok) {
    const detail = data && (data.error?.message || data.detail || data.error || data.message);
    const msg = typeof detail === "string" ? detail : JSON.stringify(detail ?? text);
    throw new ApiError(res.status, res.status === 401 || res.status === 403
      ? `The API key was refused (${res.status}): ${msg}` : `${method} ${path} failed (${res.status}): ${msg}`);
  }
  return data;
}

// Lists come back bare or wrapped ({"data": [...]}, OpenAI style); the page wants arrays.
function list(data, ...keys) {
  if (Array.isArray(data)) return data;
  for (const k of ["data", ...keys]) if (data && Array.isArray(data[k])) return data[k];
  return [];
}

const U = (user) => `/v1/users/${enc(user)}`;

export const api = {
  users: async () => list(await request("GET", "/v1/users?limit=1000"), "users"),
  memories: async (user) => list(await request("GET", `${U(user)}/memories?status=all&limit=1000`), "memories"),
  addMemory: (user, text) => request("POST", `${U(user)}/memories`, { text }),
  correctMemory: (user, id, text) => request("PATCH", `${U(user)}/memories/${enc(id)}`, { text }),
  deleteMemory: (user, id) => request("DELETE", `${U(user)}/memories/${enc(id)}`),
  coreBlocks: async (user) => list(await request("GET", `${U(user)}/core?limit=1000`), "blocks"),
  setCoreBlock: (user, label, value) => request("PUT", `${U(user)}/core/${enc(label)}`, { value }),
  sessions: async (user) => list(await request("GET", `${U(user)}/sessions?limit=1000`), "sessions"),
  messages: async (user, session) =>
    list(await request("GET", `${U(user)}/sessions/${enc(session)}/messages?limit=1000`), "messages"),
  turns: async (user) => list(await request("GET", `${U(user)}/turns?limit=500`), "turns"),
};
